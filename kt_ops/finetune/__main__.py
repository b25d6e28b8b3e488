"""``python -m kt_ops.finetune`` (and under ``torchrun ... -m kt_ops.finetune``)."""
import sys

from kt_ops.finetune.cli import main

sys.exit(main())
