"""``python -m kt_ops.finetune`` (and under ``torchrun ... -m kt_ops.finetune``); with
``--trainer dpo``, DPO with TRL's DPOTrainer (:mod:`kt_ops.finetune.dpo`)."""
import sys


def _trainer(argv):
    """The value of ``--trainer`` in argv (default "sft") and the other arguments."""
    rest, trainer, i = [], "sft", 0
    while i < len(argv):
        if argv[i] == "--trainer" and i + 1 < len(argv):
            trainer, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--trainer="):
            trainer = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return trainer, rest


trainer, rest = _trainer(sys.argv[1:])
if trainer == "dpo":
    from kt_ops.finetune.dpo import main
    sys.exit(main(rest))
from kt_ops.finetune.cli import main  # noqa: E402

sys.exit(main())
