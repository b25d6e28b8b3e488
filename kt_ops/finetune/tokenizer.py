"""A byte-level tokenizer: one token per UTF-8 byte, plus three special tokens.

Used by ``kt_ops.finetune`` for its built-in demo model, which has no tokenizer of its own
(and nothing may be downloaded). ``vocab_size`` is 259: ids 0-255 are the bytes, then
``bos`` (256), ``eos`` (257) and ``pad`` (258).
"""
from __future__ import annotations

import json
import os
from typing import Iterable


class ByteTokenizer:
    """``encode(text) -> list[int]`` over UTF-8 bytes; ``decode(ids) -> str`` (special tokens
    dropped, invalid UTF-8 replaced)."""

    num_bytes = 256
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < self.num_bytes)
        return data.decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size

    def save_pretrained(self, directory: str) -> str:
        """Writes ``kt_byte_tokenizer.json`` (a description: the tokenizer has no learned state)."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "kt_byte_tokenizer.json")
        with open(path, "w") as f:
            json.dump({"type": "kt_ops.tokenizer.ByteTokenizer", "vocab_size": self.vocab_size,
                       "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                       "pad_token_id": self.pad_token_id}, f, indent=2)
        return path
