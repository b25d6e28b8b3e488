"""Trainer checkpoints of a multi-rank kt job: what each holds, whether it is complete, and
which one a resume may read.

In a kt job the ranks train different parameter sets (only expert owners hold the expert
LoRA), so each rank's optimizer state is its own: rank 0's is the Trainer's ``optimizer.pt``,
rank r's (r >= 1) ``optimizer_<r>.pt``, beside the Trainer's per-rank ``rng_state_<r>.pth``.
``kt_checkpoint.json``, written last by rank 0, records the job's layout (world size, the
ranks owning experts) and the files the checkpoint must hold. A checkpoint is complete when
every listed file is there and every rank can read its own files; a resume is refused, on
every rank and before any step, when the layout differs from the running job's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

LAYOUT_FILE = "kt_checkpoint.json"
TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


@dataclasses.dataclass(frozen=True)
class JobLayout:
    """Where a job's experts live: its number of ranks and the global ranks owning experts."""
    world_size: int
    expert_owners: tuple[int, ...]

    def describe(self) -> str:
        owners = ", ".join(map(str, self.expert_owners)) or "none"
        return f"{self.world_size} rank(s) with experts on rank(s) {owners}"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_ranks(value: Any) -> list:
    """``value`` of every rank, by rank (a collective when there are several ranks)."""
    rank, world = _world()
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def job_layout(model: nn.Module) -> JobLayout:
    """The running job's layout. A collective when there are several ranks: every rank calls it."""
    from kt_ops.distributed import _kt_layers

    owns = any(layer.is_owner for _, layer in _kt_layers(model))
    owners = tuple(r for r, o in enumerate(all_ranks(owns)) if o)
    return JobLayout(_world()[1], owners)


def optimizer_file(rank: int) -> str:
    return "optimizer.pt" if rank == 0 else f"optimizer_{rank}.pt"


def rng_file(rank: int, world_size: int) -> str:
    return "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"


def save_atomically(obj: Any, path: str) -> None:
    """``torch.save`` through a temporary name: a kill mid-write leaves no file of that name."""
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_layout(folder: str, layout: JobLayout, per_rank_files: list[str]) -> None:
    """Rank 0, last in a checkpoint's save: the layout and every file the checkpoint must hold
    (what is there now, rank 0's own files, plus each rank's files, which may still be written)."""
    present = [n for n in os.listdir(folder) if ".tmp" not in n and n != LAYOUT_FILE]
    record = {"world_size": layout.world_size, "expert_owners": list(layout.expert_owners),
              "files": sorted(set(present) | set(per_rank_files))}
    tmp = os.path.join(folder, f"{LAYOUT_FILE}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(folder, LAYOUT_FILE))


def read_layout(folder: str) -> tuple[Optional[JobLayout], list[str], Optional[str]]:
    """``(layout, files, problem)`` of a checkpoint folder; ``problem`` says why it has none."""
    path = os.path.join(folder, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None, [], (f"{LAYOUT_FILE} is missing (kt_ops writes it last: the save did not finish, or the "
                          "checkpoint was not written by a Trainer with kt_ops.hf.KTAdapterCallback)")
    try:
        with open(path) as f:
            record = json.load(f)
        return JobLayout(int(record["world_size"]), tuple(record["expert_owners"])), list(record["files"]), None
    except (ValueError, KeyError, TypeError) as error:
        return None, [], f"{LAYOUT_FILE} is unreadable ({error})"


class CheckpointReader:
    """One rank's check of a checkpoint folder (every file listed is there, this rank's own
    files and the shared ones load); keeps this rank's optimizer and scheduler states for the
    resume, so that the Trainer does not read them again."""

    def __init__(self, folder: str, rank: int):
        self.folder, self.rank = folder, rank
        self.layout: Optional[JobLayout] = None
        self.optimizer_state: Optional[dict] = None
        self.scheduler_state: Optional[dict] = None

    def problems(self) -> list[str]:
        if not os.path.isdir(self.folder):
            return [f"{self.folder} is not a folder"]
        self.layout, files, problem = read_layout(self.folder)
        if problem:
            return [problem]
        missing = [n for n in files if not os.path.exists(os.path.join(self.folder, n))]
        if missing:
            return [f"{', '.join(missing)} missing"]
        found = []
        for name in files:
            path = os.path.join(self.folder, name)
            if name.endswith(".safetensors"):
                found += self._check(name, lambda: _safetensors_keys(path))
            elif name.endswith(".json"):
                found += self._check(name, lambda: _read_json(path))
        if TRAINER_STATE not in files:
            found.append(f"{TRAINER_STATE} is not listed in {LAYOUT_FILE}")
        if self.rank < self.layout.world_size:  # otherwise the layout check refuses it
            kept = {optimizer_file(self.rank): "optimizer_state", SCHEDULER: "scheduler_state",
                    rng_file(self.rank, self.layout.world_size): None}  # the RNG state: the Trainer reads it
            for name, attribute in kept.items():
                if name in files:
                    found += self._check(name, lambda: self._load(name, attribute))
        return found

    def _load(self, name: str, attribute: Optional[str]) -> None:
        state = _torch_load(os.path.join(self.folder, name))
        if attribute is not None:
            setattr(self, attribute, state)

    @staticmethod
    def _check(name: str, read) -> list[str]:
        try:
            read()
            return []
        except Exception as error:  # noqa: BLE001  any failure to read it: corrupt or truncated
            return [f"{name} is unreadable ({type(error).__name__}: {str(error)[:200]})"]


def _safetensors_keys(path: str) -> list[str]:
    from safetensors import safe_open
    with safe_open(path, "pt") as f:  # checks the header against the file's length
        return list(f.keys())


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _torch_load(path: str):
    from transformers.trainer_pt_utils import safe_globals  # the numpy types of the Trainer's RNG states

    with safe_globals():
        return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_folders(output_dir: str) -> list[str]:
    """``checkpoint-<step>`` folders of ``output_dir``, newest (highest step) first."""
    if not os.path.isdir(output_dir):
        return []
    steps = [(int(m.group(1)), n) for n in os.listdir(output_dir) if (m := _CHECKPOINT_DIR.match(n))
             and os.path.isdir(os.path.join(output_dir, n))]
    return [os.path.join(output_dir, n) for _, n in sorted(steps, reverse=True)]


def _problems_of_every_rank(reader: CheckpointReader) -> dict[int, list[str]]:
    """``{rank: problems}`` of the ranks that found any (the same on every rank)."""
    return {r: p for r, p in enumerate(all_ranks(reader.problems())) if p}


def _describe(problems: dict[int, list[str]]) -> str:
    """The problems, by rank where the ranks found different ones."""
    ranks = sorted(problems)
    if len(ranks) == _world()[1] and all(problems[r] == problems[ranks[0]] for r in ranks):
        return "; ".join(problems[ranks[0]])
    return "; ".join(f"rank {r}: " + "; ".join(p) for r, p in problems.items())


def open_for_resume(resume: str, output_dir: str, layout: JobLayout) -> CheckpointReader:
    """The checkpoint to resume from, checked on every rank (every rank calls this).

    ``resume``: a folder, or ``"latest"``: the newest complete checkpoint of ``output_dir``
    (incomplete or unreadable ones are skipped with a warning naming what is wrong). Raises
    ValueError, on every rank alike, when a named checkpoint is incomplete or unreadable (the
    file named), when there is no complete one, or when its layout is not ``layout``."""
    rank, _ = _world()
    if resume == "latest":
        skipped = []
        for folder in checkpoint_folders(output_dir):
            reader = CheckpointReader(folder, rank)
            problems = _problems_of_every_rank(reader)
            if not problems:
                break
            skipped.append(f"{folder}: {_describe(problems)}")
            if rank == 0:
                warnings.warn(f"kt_ops: skipping incomplete checkpoint {folder}: {_describe(problems)}", stacklevel=3)
        else:
            raise ValueError(f"kt_ops: --resume latest: no complete checkpoint in {output_dir}"
                             + (f" (skipped {'; '.join(skipped)})" if skipped else ""))
    else:
        reader = CheckpointReader(resume, rank)
        problems = _problems_of_every_rank(reader)
        if problems:
            raise ValueError(f"kt_ops: cannot resume from {resume}: {_describe(problems)}")
    if reader.layout != layout:
        raise ValueError(f"kt_ops: cannot resume from {reader.folder}: it was written by a job of "
                         f"{reader.layout.describe()}, this job has {layout.describe()}; resume with the "
                         "checkpoint's layout (each rank's optimizer state is its own)")
    return reader
