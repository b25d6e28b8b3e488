"""Moved to :mod:`kt_ops.finetune.tokenizer`; this name stays for existing imports."""
from kt_ops.finetune.tokenizer import ByteTokenizer  # noqa: F401
