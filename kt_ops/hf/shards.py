"""A checkpoint directory's safetensors shards, read tensor by tensor with bounded memory.

safetensors memory-maps a shard; every page a read touches stays resident (and counts in the
process' RSS) until the mapping is closed. :class:`ShardReader` therefore closes and reopens
its mapping after every ``remap_bytes`` read, so a 5 GB shard never sits whole in memory.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from safetensors import safe_open
from torch import Tensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
REMAP_BYTES = 256 << 20


def shard_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory, in the index's order."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map'")
        files = list(dict.fromkeys(weight_map.values()))
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise ValueError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; kt_ops.hf.from_pretrained reads "
                         "safetensors checkpoints from a local directory")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"{path}: shard(s) {missing} named by {INDEX_FILE} are missing")
    return [os.path.join(path, f) for f in files]


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one stored tensor is, and what its header says (no data read)."""
    file: str
    key: str
    shape: tuple
    dtype: str  # safetensors' dtype name: "BF16", "F8_E4M3", "I32", ...

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2}


def nbytes_of(dtype: str, shape) -> int:
    """The bytes of a stored tensor of safetensors dtype ``dtype`` (one byte unless listed) and ``shape``."""
    n = _ITEMSIZE.get(dtype, 1)
    for d in shape:
        n *= int(d)
    return n


def tensor_refs(file: str) -> list[TensorRef]:
    """Every tensor of a shard, from its header only."""
    with safe_open(file, framework="pt") as f:
        refs = []
        for key in f.keys():
            s = f.get_slice(key)
            refs.append(TensorRef(file, key, tuple(s.get_shape()), s.get_dtype()))
    return refs


class ShardReader:
    """Reads tensors of one shard, remapping it every ``remap_bytes`` (see the module doc).
    ``tensors_read`` / ``bytes_read`` count what was read."""

    def __init__(self, file: str, remap_bytes: int = REMAP_BYTES):
        self.file, self.remap_bytes = file, remap_bytes
        self._handle, self._mapped_bytes = None, 0
        self.tensors_read, self.bytes_read = 0, 0

    def read(self, ref: TensorRef, index: Optional[int] = None) -> Tensor:
        """The tensor ``ref`` (``index``: only its ``[index]`` sub-tensor), copied out of the
        mapping so that the pages can go."""
        if self._handle is None or self._mapped_bytes >= self.remap_bytes:
            self.close()
            self._handle = safe_open(self.file, framework="pt")
        nbytes = ref.nbytes // ref.shape[0] if index is not None else ref.nbytes
        if index is not None:
            tensor = self._handle.get_slice(ref.key)[index:index + 1][0]
        else:
            tensor = self._handle.get_tensor(ref.key)
        self._mapped_bytes += nbytes
        self.tensors_read += 1
        self.bytes_read += nbytes
        return tensor.clone()

    def close(self) -> None:
        self._handle, self._mapped_bytes = None, 0
