"""Safetensors shards written tensor by tensor, and stored tensors copied byte for byte.

``safetensors.torch.save_file`` needs every tensor of a shard in memory at once: a 5 GB shard
of a 650 GB checkpoint would be held whole. The format is simple enough to stream instead: an
8-byte little-endian header length, a JSON header (``{key: {"dtype", "shape", "data_offsets"}}``
and ``__metadata__``, padded with spaces to 8 bytes), then the tensors' bytes back to back. A
:class:`StreamingShard` writes the header from a plan made beforehand (names, dtypes, shapes),
then each tensor's bytes as they come, checking each against the plan; its :meth:`copy_from`
copies a stored tensor's bytes from its shard straight across, so an untouched tensor is
byte-identical and never decoded.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Optional

import torch
from torch import Tensor

from kt_ops.hf.shards import nbytes_of

# torch dtype -> safetensors' dtype name
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
COPY_CHUNK = 64 << 20


def read_header(file: str) -> tuple[dict, int, Optional[dict]]:
    """``({key: {"dtype", "shape", "data_offsets"}}, offset of the data, __metadata__)`` of a
    safetensors file."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    metadata = header.pop("__metadata__", None)
    return header, 8 + length, metadata


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    key: str
    dtype: str  # safetensors' name
    shape: tuple

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


class StreamingShard:
    """One output shard: the header of ``planned`` first, then :meth:`write` / :meth:`copy_from`
    in the planned order. :meth:`close` checks that everything planned was written."""

    def __init__(self, path: str, planned: list[PlannedTensor], metadata: Optional[dict] = None):
        self.path, self.planned, self._next = path, planned, 0
        header, offset = {}, 0
        for t in planned:
            header[t.key] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        if metadata:
            header["__metadata__"] = metadata
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self.bytes_written = 0

    def _expect(self, key: str) -> PlannedTensor:
        if self._next >= len(self.planned) or self.planned[self._next].key != key:
            want = self.planned[self._next].key if self._next < len(self.planned) else "nothing"
            raise RuntimeError(f"{self.path}: writing {key!r} where the plan has {want!r}")  # a bug of ours
        self._next += 1
        return self.planned[self._next - 1]

    def write(self, key: str, tensor: Tensor) -> None:
        """The bytes of ``tensor`` (its dtype and shape must be the planned ones)."""
        planned = self._expect(key)
        if ST_DTYPES.get(tensor.dtype) != planned.dtype or tuple(tensor.shape) != tuple(planned.shape):
            raise RuntimeError(f"{key}: computed {tensor.dtype} {tuple(tensor.shape)}, planned {planned.dtype} "
                               f"{tuple(planned.shape)}")  # a bug of ours
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self.bytes_written += planned.nbytes

    def copy_from(self, key: str, file: str, begin: int, end: int) -> None:
        """Bytes ``[begin, end)`` of ``file`` (a stored tensor's), in chunks of COPY_CHUNK."""
        planned = self._expect(key)
        if end - begin != planned.nbytes:
            raise RuntimeError(f"{key}: {end - begin} bytes stored, {planned.nbytes} planned")  # a bug of ours
        with open(file, "rb") as src:
            src.seek(begin)
            left = end - begin
            while left:
                chunk = src.read(min(left, COPY_CHUNK))
                if not chunk:
                    raise ValueError(f"{file}: ends inside tensor {key!r} (a truncated shard)")
                self._file.write(chunk)
                left -= len(chunk)
        self.bytes_written += planned.nbytes

    def close(self) -> None:
        if self._next != len(self.planned):
            raise RuntimeError(f"{self.path}: {self.planned[self._next].key!r} was planned but not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()
