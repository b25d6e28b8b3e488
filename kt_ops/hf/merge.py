"""``kt_ops.hf.merge_adapter``: a trained adapter merged into its base checkpoint, streamed
shard by shard, written in the base's own format.

A merged checkpoint is what every serving engine loads. For a DeepSeek-V3-class model that is
a 650 GB FP8 checkpoint: the merge cannot load the model, and re-saving it in bf16 would double
it. So the base is read as stored, one tensor at a time (:mod:`kt_ops.hf.shards`), and written
shard by shard with the same names (:mod:`kt_ops.hf.shard_writer`):

* a tensor the adapter does not touch is copied byte for byte, never decoded;
* a weight with a LoRA delta (PEFT's LoRA on attention and other linear modules:
  ``<module>.lora_A.weight [r, in]`` / ``lora_B.weight [out, r]``; kt's on the routed experts,
  in PEFT's layout, see :mod:`kt_ops.hf.adapters`) is decoded to float32, gets
  ``W + s·B·A`` and is encoded again (:mod:`kt_ops.hf.merge_formats`): FP8 blocks with their
  scales recomputed, compressed-tensors INT4 and GPTQ INT4 requantized with their group size,
  float cast back to its dtype.

Checkpoint names are matched to the model's (and so to the adapter's) with the plan
:func:`~kt_ops.hf.from_pretrained` loads with (transformers' conversion mapping, on a meta
model), and everything is checked against the headers before a byte is written. The output is
built in a temporary folder beside ``out_dir`` and renamed at the end: a failure or an
interrupt leaves no ``out_dir``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import socket
from typing import Optional, Union

import torch
from torch import Tensor

from kt_ops import quantization
from kt_ops.distributed import PEFT_MODEL_PREFIX
from kt_ops.hf import fp4_checkpoints
from kt_ops.hf.adapters import (ADAPTER_CONFIG, _KEY_RE, _read_adapter_weights, lora_fields, peft_factors_to_kt,
                                read_adapter_config)
from kt_ops.hf.checkpoint_formats import CheckpointQuantization, StoredMatrix
from kt_ops.hf.merge_formats import (CONVERSIONS, check_writable, converted_layout, encode_as, encode_like,
                                     quantization_config)
from kt_ops.hf.shard_writer import PlannedTensor, StreamingShard, read_header
from kt_ops.hf.shards import INDEX_FILE, ShardReader, TensorRef, shard_files
from kt_ops.signals import sigterm_raises_system_exit

OUTPUT_FORMATS = ("same",) + CONVERSIONS
_LINEAR_KEY = re.compile(r"^(.+)\.lora_([AB])\.weight$")
_WHO = "merge_adapter"


@dataclasses.dataclass
class MergeSummary:
    """What a merge wrote: ``merged``, the checkpoint keys whose tensors got a LoRA delta (or
    new scales with it); ``converted``, the weights written in another format than stored
    (``output_format`` other than "same"); ``copied``, how many tensors were copied byte for
    byte without being decoded. (The unchanged parts of a merged weight, e.g. GPTQ's
    ``qzeros`` and ``g_idx``, are in neither list: read and written back as they are.)"""
    out_dir: str
    merged: list = dataclasses.field(default_factory=list)
    converted: list = dataclasses.field(default_factory=list)
    copied: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


def merge_adapter(base_dir: Union[str, os.PathLike], adapter_dir: Union[str, os.PathLike],
                  out_dir: Union[str, os.PathLike], *, output_format: str = "same", group_size: int = 32,
                  progress: bool = True, overwrite: bool = False) -> MergeSummary:
    """Merge the PEFT-format adapter ``adapter_dir`` (what :func:`kt_ops.hf.save_adapter`
    writes: kt's expert LoRA, and PEFT's LoRA on attention or other linear modules) into the
    checkpoint ``base_dir`` and write the result to ``out_dir``.

    ``output_format``: ``"same"`` keeps the base's format (bf16 / fp16 / fp32; FP8 with
    128x128 block, per-row or per-tensor scales, DeepSeek's or compressed-tensors'; INT8;
    compressed-tensors pack-quantized INT4; GPTQ INT4), requantizing only the weights the
    adapter changes; ``"bf16"`` writes every quantized weight dequantized as a bf16
    ``X.weight`` (float tensors keep their dtype) and drops ``quantization_config``;
    ``"fp8"`` (DeepSeek-V3's 128x128 blocks, ``quant_method: fp8``), ``"int8"`` and
    ``"int4"`` (compressed-tensors' int-quantized per channel and pack-quantized, groups of
    ``group_size``) quantize the weights of every ``nn.Linear`` but the output embeddings and
    every routed expert's (experts stored one per expert), other quantized weights written as
    bf16. A base already in that format is merged as ``"same"``.

    The output has the base's shard files and index, its ``config.json`` (with a
    ``quantization_config`` describing what was written) and every other file of ``base_dir``
    (tokenizer, generation config) copied. Memory: the largest input shard at most (usually
    one tensor and the fused experts of one layer in float32) plus the mapped shard pages
    (:data:`~kt_ops.hf.shards.REMAP_BYTES`).

    Raises:
        ValueError: ``out_dir`` exists (without ``overwrite=True``) or is ``base_dir``; an
            unknown ``output_format``; a base checkpoint kt_ops cannot read; an adapter whose
            config or tensors do not fit the base (another architecture, number of experts,
            layers or shapes, a rank other than its config's): the first mismatching key is
            named, before anything is written; a merged weight with NaN or inf (named).
    """
    base_dir, adapter_dir, out_dir = (os.path.abspath(os.fspath(p)) for p in (base_dir, adapter_dir, out_dir))
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"{_WHO}: output_format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
    for name, path in (("base_dir", base_dir), ("adapter_dir", adapter_dir)):
        if not os.path.isdir(path):
            raise ValueError(f"{_WHO}: {name} {path!r} is not a directory")
    if out_dir in (base_dir, adapter_dir):
        raise ValueError(f"{_WHO}: out_dir must be a new directory, not the base's or the adapter's ({out_dir!r})")
    if os.path.lexists(out_dir) and not overwrite:
        raise ValueError(f"{_WHO}: out_dir {out_dir!r} exists; pass overwrite=True (--overwrite) to replace it")

    if output_format == "int4" and group_size not in quantization.GROUP_SIZES:
        raise ValueError(f"{_WHO}: group_size must be one of {quantization.GROUP_SIZES}, got {group_size!r}")
    plan = _MergePlan(base_dir, adapter_dir, output_format, group_size)  # every check; nothing written yet
    parent, leaf = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    _remove_abandoned(parent, leaf)
    free = shutil.disk_usage(parent).free
    if free < plan.index_metadata["total_size"]:
        raise ValueError(f"{_WHO}: the merged checkpoint needs {plan.index_metadata['total_size'] / 1e9:.2f} GB; "
                         f"{parent!r} has {free / 1e9:.2f} GB free")
    tmp = os.path.join(parent, f"{_temp_prefix(leaf)}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with sigterm_raises_system_exit():  # `kill` cleans up as Ctrl-C does
            summary = plan.write(tmp, progress)
            _write_config_and_files(base_dir, tmp, plan)
            _replace(tmp, out_dir)
    except BaseException:  # an error, Ctrl-C, SIGTERM: nothing that looks like a checkpoint stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary.out_dir = out_dir
    return summary


def _temp_prefix(leaf: str) -> str:
    """The temporary folder's name less the pid: hidden, beside out_dir, naming this host (a
    shared file system may see merges of several machines)."""
    return f".{leaf}.merging-{socket.gethostname()}-"


def _remove_abandoned(parent: str, leaf: str) -> None:
    """The temporary folders of earlier merges to the same out_dir on this host whose process is
    gone (killed: nothing could clean up)."""
    prefix = _temp_prefix(leaf)
    for entry in os.listdir(parent):
        pid = entry[len(prefix):]
        if not (entry.startswith(prefix) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def _replace(tmp: str, out_dir: str) -> None:
    """``tmp`` becomes ``out_dir`` (an existing one, allowed by overwrite, is removed after)."""
    if not os.path.lexists(out_dir):
        os.rename(tmp, out_dir)
        return
    old = tmp + ".replaced"
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


# ---------------------------------------------------------------------------------------------
# The adapter


@dataclasses.dataclass
class _Adapter:
    scaling: float
    linear: dict  # model key of a weight -> (A [r, in], B [out, r])
    experts: dict  # experts path -> {"gate_up" | "down": (A [E, r, in], B [E, out, r])}


def _adapter_scaling(adapter_dir: str) -> tuple[int, float]:
    """``(r, scaling)`` of the adapter's config, checked as loading checks it (and
    ``fan_in_fan_out``: a Conv1D layout the merge does not write)."""
    config = read_adapter_config(adapter_dir, _WHO)
    where = f"{_WHO}: adapter_dir {adapter_dir!r}"
    r, _, scaling = lora_fields(config, where)
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out=true is not supported by the merge")
    return r, scaling


def _factor_pair(pair: dict) -> tuple:
    """``((A's key, A), (B's key, B))`` of one LoRA; ValueError naming a factor without its partner."""
    if set(pair) != {"A", "B"}:
        (key, _), = pair.values()
        raise ValueError(f"{_WHO}: adapter key {key!r} has no lora_{'B' if 'A' in pair else 'A'} partner")
    return pair["A"], pair["B"]


def _read_adapter(adapter_dir: str, plan, weights_by_target: dict, stored) -> _Adapter:
    """The adapter's LoRA factors, each checked against the base weight it changes (from the
    headers): ValueError naming the first key that does not fit."""
    from kt_ops.hf.loading import _logical_shape

    r, scaling = _adapter_scaling(adapter_dir)
    state = _read_adapter_weights(adapter_dir)
    linear_parts: dict = {}
    expert_parts: dict = {}
    experts_paths = sorted(plan.experts_paths, key=len, reverse=True)
    for key in sorted(state):
        name = key[len(PEFT_MODEL_PREFIX):] if key.startswith(PEFT_MODEL_PREFIX) else key
        path = next((p for p in experts_paths if name.startswith(p + ".")), None)
        if path is not None:
            m = _KEY_RE.match("experts." + name[len(path) + 1:])
            if m is None:
                raise ValueError(f"{_WHO}: adapter key {key!r}: not a LoRA factor of the experts {path}")
            expert_parts.setdefault(path, {}).setdefault(m.group(1), {})[m.group(2)] = (key, state[key])
            continue
        m = _LINEAR_KEY.match(name)
        if m is None:
            raise ValueError(f"{_WHO}: adapter key {key!r}: a merge takes LoRA factors (<module>.lora_A.weight / "
                             "lora_B.weight); embeddings' LoRA, DoRA magnitudes, LoRA biases and modules_to_save are "
                             "not supported")
        linear_parts.setdefault(m.group(1) + ".weight", {})[m.group(2)] = (key, state[key])

    linear = {}
    for target, pair in linear_parts.items():
        (a_key, a), (b_key, b) = _factor_pair(pair)
        weight = weights_by_target.get(target)
        if weight is None:
            raise ValueError(f"{_WHO}: adapter key {a_key!r}: the base checkpoint has no weight {target} (an adapter "
                             "for another architecture or number of layers?)")
        if weight.converter is not None or weight.slot is not None:
            raise ValueError(f"{_WHO}: adapter key {a_key!r}: {target} is built from several stored tensors by "
                             "transformers' conversion; a merge writes LoRA into weights stored as the model holds them")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            bad = a_key if a.dim() != 2 or a.shape[0] != r else b_key
            raise ValueError(f"{_WHO}: adapter key {bad!r}: shapes {tuple(a.shape)} / {tuple(b.shape)} do not have "
                             f"the rank r={r} of {ADAPTER_CONFIG}")
        out, inp = _logical_shape(weight.parts, stored.int8_is_fp4)[-2:]
        if (b.shape[0], a.shape[1]) != (out, inp):
            bad = a_key if a.shape[1] != inp else b_key
            raise ValueError(f"{_WHO}: adapter key {bad!r}: LoRA of a [{b.shape[0]}, {a.shape[1]}] weight, but the "
                             f"base's {weight.name} is [{out}, {inp}]")
        linear[target] = (a, b)

    experts = {}
    for path, nestings in expert_parts.items():
        E, two_i, H = plan.expert_shapes[path]
        I = two_i // 2
        factors = {}
        for pair in nestings.values():
            (a_key, a), (b_key, b) = _factor_pair(pair)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r * E or b.shape[1] != r * E:
                bad = a_key if a.dim() != 2 or a.shape[0] != r * E else b_key
                raise ValueError(f"{_WHO}: adapter key {bad!r}: shapes {tuple(a.shape)} / {tuple(b.shape)}; {path} "
                                 f"with E={E} experts and the rank r={r} of {ADAPTER_CONFIG} needs [r·E, in] / "
                                 f"[out, r·E] = [{r * E}, in] / [out, {r * E}]")
            proj = ("gate_up" if (a.shape[1], b.shape[0]) == (H, 2 * I) else
                    "down" if (a.shape[1], b.shape[0]) == (I, H) else None)
            if proj is None:
                raise ValueError(f"{_WHO}: adapter key {a_key!r}: LoRA of a [{b.shape[0]}, {a.shape[1]}] matrix per "
                                 f"expert fits neither gate_up_proj [{2 * I}, {H}] nor down_proj [{H}, {I}] of {path}")
            if proj in factors:
                raise ValueError(f"{_WHO}: adapter key {a_key!r}: a second LoRA for {path}'s {proj}_proj")
            factors[proj] = peft_factors_to_kt(a, b, E)
        experts[path] = factors
    return _Adapter(scaling, linear, experts)


# ---------------------------------------------------------------------------------------------
# The plan: which stored tensors change, where each output tensor comes from


@dataclasses.dataclass
class _Unit:
    """One stored matrix that is rewritten: its weight, its stored tensors by role, whether it
    gets a LoRA delta, and how it is written: ``kind`` "same" (its own tensors, re-encoded) or
    one of merge_formats.CONVERSIONS; ``outputs`` [(PlannedTensor, what: a role for "same",
    else the output key)]."""
    weight: object  # loading._Weight
    name: str  # the stored weight's key ("X.weight")
    parts: dict  # role -> TensorRef
    merged: bool
    kind: str
    outputs: list = dataclasses.field(default_factory=list)

    @property
    def main_key(self) -> str:
        """The stored values' key: where a converted weight's tensors are written."""
        role = next(r for r in ("qweight", "packed", "fp4_packed", "mx_blocks", "value") if r in self.parts)
        return self.parts[role].key


class _MergePlan:
    """Everything checked from the headers, and the output shards planned, before writing."""

    def __init__(self, base_dir: str, adapter_dir: str, output_format: str, group_size: int):
        from accelerate import init_empty_weights
        from transformers import AutoConfig

        from kt_ops.hf.loading import _Plan, _build_model

        self.files = shard_files(base_dir)
        config = AutoConfig.from_pretrained(base_dir)
        self.stored = CheckpointQuantization.from_config(getattr(config, "quantization_config", None)
                                                         or fp4_checkpoints.hf_quant_config(base_dir))
        self.output_format, self.group_size = self._resolve(output_format, group_size), group_size
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with init_empty_weights(include_buffers=False), torch.random.fork_rng(devices=[]):
            model = _build_model(config, torch.float32)
        self.plan = _Plan(model, self.stored)
        # the weights of nn.Linear modules (what transformers' and compressed-tensors' quantizers
        # quantize), but the output embeddings
        head = model.get_output_embeddings()
        self.head_names = [n for n, m in model.named_modules() if head is not None and m is head]
        self.linear = {f"{n}.weight" for n, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and m is not head}
        # each shard's header, read once: the tensors' refs for the plan, their offsets for the copy
        self.headers = {f: read_header(f) for f in self.files}
        weights = self.plan.weights_of([TensorRef(f, key, tuple(entry["shape"]), entry["dtype"])
                                        for f, (header, _, _) in self.headers.items()
                                        for key, entry in sorted(header.items())])
        by_target = {w.target: w for w in weights if w.slot is None and w.converter is None}
        self.adapter = _read_adapter(adapter_dir, self.plan, by_target, self.stored)
        self.units = self._units(weights)
        self.unit_of = {ref.key: unit for unit in self.units for ref in unit.parts.values()}
        self.shards = self._shards()
        self.index_metadata = {"total_size": sum(t.nbytes for planned in self.shards.values() for t, _ in planned)}
        converted = {u.weight.target for u in self.units if u.kind == self.output_format}
        self.not_converted = sorted(t[: -len(".weight")] for t in self.linear - converted) + self.head_names

    def _resolve(self, output_format: str, group_size: int) -> str:
        """"same" where the base already stores ``output_format`` as it would be written."""
        s = self.stored
        if ((output_format == "fp8" and (s.method, s.quant_method) == ("fp8", "fp8"))
                or (output_format == "int8" and s.method == "int8")
                or (output_format == "int4" and (s.method, s.quant_method, s.group_size)
                    == ("int4", "compressed-tensors", group_size))):
            return "same"
        return output_format

    def _touched(self, weight) -> bool:
        if weight.slot is None:
            return weight.target in self.adapter.linear
        factors = self.adapter.experts.get(weight.slot.path, {})
        proj = weight.slot.proj
        return ("down" if proj == "down_proj" else "gate_up" if proj in ("gate_up_proj", "gate_proj", "up_proj")
                else None) in factors

    def _kind(self, weight, name: str, parts: dict, merged: bool) -> Optional[str]:
        """How one stored matrix is written (None: copied as it is)."""
        from kt_ops.hf.loading import _logical_shape

        quantized = set(parts) != {"value"}
        fmt = self.output_format
        if fmt in ("fp8", "int8", "int4") and weight.converter is None:
            shape = _logical_shape(parts, self.stored.int8_is_fp4)
            slot = weight.slot
            if slot is not None and slot.expert is None and slot.proj in ("gate_up_proj", "down_proj"):
                raise ValueError(f"{_WHO}: {name}: experts stored fused (one tensor for all experts); "
                                 f"output_format={fmt!r} writes experts stored one per expert (the hub layout); use "
                                 "'same' or 'bf16'")
            if (weight.target in self.linear if slot is None else slot.proj in ("gate_proj", "up_proj", "down_proj")) \
                    and len(shape) == 2 and (fmt != "int4" or shape[1] % self.group_size == 0):
                return fmt
        if fmt != "same" and quantized:
            return "bf16"
        if merged:
            if weight.slot is not None and weight.slot.expert is None and quantized and "mx_blocks" not in parts:
                raise ValueError(f"{_WHO}: {name}: experts stored fused and quantized as {sorted(parts)}; the merge "
                                 "reads fused quantized experts as gpt-oss's MXFP4 only")
            if quantized:
                check_writable(parts, name)
            return "same"
        return None

    def _units(self, weights) -> list[_Unit]:
        from kt_ops.hf.loading import _logical_shape

        units = []
        for weight in weights:
            merged = self._touched(weight)
            for name, parts in weight.sources.items():
                kind = self._kind(weight, name, parts, merged)
                if kind is None:
                    continue
                unit = _Unit(weight, name, parts, merged, kind)
                if kind == "same":
                    unit.outputs = [(PlannedTensor(ref.key, ref.dtype, ref.shape), role) for role, ref in parts.items()]
                else:
                    shape = tuple(_logical_shape(parts, self.stored.int8_is_fp4))
                    unit.outputs = [(PlannedTensor(key, dtype, tuple(shape_)), key)
                                    for key, dtype, shape_ in converted_layout(kind, name, shape, self.group_size)]
                units.append(unit)
        return units

    def _shards(self) -> dict:
        """file -> [(PlannedTensor, source)] in the stored order; source: ("copy", begin, end)
        or ("unit", unit, role or output key)."""
        shards = {}
        for file in self.files:
            header, data_start, _ = self.headers[file]
            planned = []
            for key in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
                unit = self.unit_of.get(key)
                if unit is None:
                    begin, end = header[key]["data_offsets"]
                    planned.append((PlannedTensor(key, header[key]["dtype"], tuple(header[key]["shape"])),
                                    ("copy", data_start + begin, data_start + end)))
                elif unit.kind == "same":
                    planned.extend((out, ("unit", unit, role)) for out, role in unit.outputs
                                   if unit.parts[role].key == key)
                elif key == unit.main_key:  # a converted weight's tensors, where its values were
                    planned.extend((out, ("unit", unit, what)) for out, what in unit.outputs)
                # else: a scale of a converted weight: replaced by its outputs
            shards[file] = planned
        return shards

    # -- writing

    def write(self, out_dir: str, progress: bool) -> MergeSummary:
        from transformers.utils.logging import tqdm

        summary = MergeSummary(out_dir)
        done: dict = {}  # unit id -> {role or output key: tensor}, computed and not yet all written
        left: dict = {}  # unit id -> its planned outputs not yet written (freed at 0)
        for planned in self.shards.values():
            for _, source in planned:
                if source[0] == "unit":
                    left[id(source[1])] = left.get(id(source[1]), 0) + 1
        readers: dict = {}
        total = sum(os.path.getsize(f) for f in self.files)
        weight_map = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc="Merging adapter", disable=not progress) as bar:
            for file in self.files:
                planned = self.shards[file]
                out_file = os.path.join(out_dir, os.path.basename(file))
                shard = StreamingShard(out_file, [t for t, _ in planned], self.headers[file][2])
                try:
                    for tensor, source in planned:
                        if source[0] == "copy":
                            shard.copy_from(tensor.key, file, source[1], source[2])
                            summary.copied += 1
                        else:
                            _, unit, role = source
                            if id(unit) not in done:
                                done[id(unit)] = self._compute(unit, readers, summary)
                            shard.write(tensor.key, done[id(unit)][role])
                            left[id(unit)] -= 1
                            if not left[id(unit)]:  # a unit spanning two shards waits for the second
                                del done[id(unit)]
                        weight_map[tensor.key] = os.path.basename(file)
                    shard.close()
                except BaseException:
                    shard.abort()
                    raise
                summary.bytes_written += shard.bytes_written
                for reader in readers.values():
                    summary.bytes_read += reader.bytes_read
                    reader.close()
                readers.clear()
                bar.update(os.path.getsize(file))
        if os.path.isfile(os.path.join(os.path.dirname(self.files[0]), INDEX_FILE)):
            with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
                json.dump({"metadata": self.index_metadata, "weight_map": weight_map}, f, indent=2)
        return summary

    def _compute(self, unit: _Unit, readers: dict, summary: MergeSummary) -> dict:
        """The unit's output tensors, by role ("same") or output key."""
        tensors = {}
        for role, ref in unit.parts.items():
            if ref.file not in readers:
                readers[ref.file] = ShardReader(ref.file)
            tensors[role] = readers[ref.file].read(ref)
        weight = self._decode(unit, tensors)
        if unit.merged:
            self._add_delta(weight, unit.weight)
            # one reduction: NaN and inf propagate through a sum (finite weights never reach 3e38)
            if not math.isfinite(float(weight.sum())):
                raise ValueError(f"{_WHO}: merging the adapter into {unit.name} gives NaN or inf values")
        if unit.kind == "same":  # only the tensors that change are new
            encoded = encode_like(tensors, weight, unit.name)
            result = {role: encoded.get(role, tensors[role]) for role in unit.parts}
            changed = [ref.key for role, ref in unit.parts.items() if role in encoded]
        else:
            result = encode_as(unit.kind, weight, unit.name, self.group_size)
            changed = list(result)
            summary.converted.append(unit.name)
        if unit.merged:
            summary.merged.extend(changed)
        return result

    def _decode(self, unit: _Unit, tensors: dict) -> Tensor:
        """The stored weight as float32, in its logical shape."""
        if set(tensors) == {"value"}:
            return tensors["value"].to(torch.float32, copy=True)
        if "mx_blocks" in tensors:  # gpt-oss's fused experts: [E, out, in/32, 16]
            blocks, scales = tensors["mx_blocks"], tensors["mx_scales"]
            return torch.stack([StoredMatrix.from_parts({"mx_blocks": blocks[e], "mx_scales": scales[e]},
                                                        unit.name).to_float() for e in range(blocks.shape[0])])
        matrix = StoredMatrix.from_parts(tensors, unit.name, self.stored.gptq_stored_zero, self.stored.int8_is_fp4)
        return matrix.to_float().float()

    def _add_delta(self, merged: Tensor, weight) -> None:
        """``merged += s·B·A`` for ``weight`` (float32, its stored orientation), in place and one
        expert at a time for fused experts, so that no second layer-sized tensor is made."""
        s = self.adapter.scaling
        if weight.slot is None:
            a, b = self.adapter.linear[weight.target]
            merged.add_(b.float() @ a.float(), alpha=s)
            return
        slot = weight.slot
        A, B = self.adapter.experts[slot.path]["down" if slot.proj == "down_proj" else "gate_up"]
        if slot.proj in ("gate_proj", "up_proj"):  # one expert's gate or up: B's rows of that half
            gate, up = self.plan.layouts[slot.path].split_gate_up(B)
            B = gate if slot.proj == "gate_proj" else up
        for e in range(A.shape[0]) if slot.expert is None else (slot.expert,):
            delta = B[e].float() @ A[e].float()  # [out, in], kt's orientation
            target = merged if slot.expert is not None else merged[e]
            target.add_(delta.t() if slot.transposed else delta, alpha=s)


def _write_config_and_files(base_dir: str, out_dir: str, plan: _MergePlan) -> None:
    """config.json, its quantization_config describing what was written, and every other
    non-weight file of the base (tokenizer, generation config, chat template ...)."""
    fmt = plan.output_format
    for entry in sorted(os.listdir(base_dir)):
        src = os.path.join(base_dir, entry)
        if not os.path.isfile(src) or entry.endswith(".safetensors") or entry in (INDEX_FILE, "config.json"):
            continue
        if fmt != "same" and entry == fp4_checkpoints.HF_QUANT_CONFIG:
            continue  # ModelOpt's: describes the base's quantization
        shutil.copy2(src, os.path.join(out_dir, entry))
    with open(os.path.join(base_dir, "config.json")) as f:
        config = json.load(f)
    if fmt != "same":
        config.pop("quantization_config", None)
    if fmt in ("fp8", "int8", "int4"):
        config["quantization_config"] = quantization_config(fmt, plan.group_size, plan.not_converted)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
