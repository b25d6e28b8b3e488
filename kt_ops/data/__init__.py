"""Moved to :mod:`kt_ops.finetune.data`; this name stays for existing imports."""
from kt_ops.finetune.data import CORPUS_PATH, read_corpus  # noqa: F401
