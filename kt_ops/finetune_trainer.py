"""Moved to :mod:`kt_ops.finetune.training`; this name stays for existing imports."""
from kt_ops.finetune.training import *  # noqa: F401,F403
from kt_ops.finetune.training import RunResult, WindowDataset, steady_tokens_per_s, train_with_trainer  # noqa: F401
