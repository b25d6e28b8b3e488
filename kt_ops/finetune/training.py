"""kt_ops.finetune's training run: a stock ``transformers.Trainer`` (accelerate underneath).

Nothing here replaces the Trainer's loop, its DDP wrapping or its all-reduce: the data is a
dataset of fixed windows, the Trainer's own sampler takes them in order ("sequential": the
windows' offsets are already drawn at random from ``--seed``, so every run and every rank sees
the same data), the model is compiled in place (``nn.Module.compile(fullgraph=True)``) before
the Trainer wraps it (accelerate's own compile would compile the DDP wrapper, whose forward
does not trace whole; DDP's gradient hooks run outside the compiled graph), and two callbacks
record the per-step losses and times, draw the progress bar (loss, tokens/s) and write
the expert adapter into each checkpoint (:class:`~kt_ops.hf.trainer.KTAdapterCallback`). The
Trainer is :class:`~kt_ops.hf.trainer.KTTrainer`: each rank's optimizer state in the
checkpoints, ``--resume latest`` to the newest complete one, a failure on one rank ending all.

Test hook: ``KT_OPS_FINETUNE_FAULT=WHAT@RANK:STEP`` makes rank RANK fail at optimizer step STEP
(1-based): ``forward`` raises in the model's forward, ``kt`` in the experts' kt.moe forward
(the owner rank), ``kt-backward`` in its backward, ``data`` in the dataset's ``__getitem__``, ``kill`` SIGKILLs the process as
the step begins, ``kill-in-save`` SIGKILLs it while the Trainer saves the checkpoint of step
STEP (after the Trainer's own files, before kt's).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from typing import Optional

import torch
from torch import Tensor, nn


class WindowDataset(torch.utils.data.Dataset):
    """Windows of ``seq_len + 1`` tokens at the given offsets, in order; ``labels`` are the
    inputs (the model shifts them: each of the last ``seq_len`` tokens is predicted)."""

    def __init__(self, tokens: Tensor, offsets: Tensor, seq_len: int):
        self.tokens, self.offsets, self.seq_len = tokens, offsets.reshape(-1), seq_len

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> dict:
        start = int(self.offsets[i])
        window = self.tokens[start:start + self.seq_len + 1]
        return {"input_ids": window, "labels": window}


def steady_tokens_per_s(tokens_per_step: int, step_times: list[float]) -> float:
    """Steady state: the first step (compilation, warm-up) is left out when there are more."""
    times = step_times[1:] if len(step_times) > 1 else step_times
    return tokens_per_step * len(times) / max(sum(times), 1e-12)


@dataclasses.dataclass
class RunResult:
    label: str
    losses: list[float]
    step_times: list[float]
    tokens_per_step: int
    wall_s: float
    first_step: int = 1  # the global step of losses[0] (later than 1 after --resume)

    @property
    def tokens_per_s(self) -> float:
        return steady_tokens_per_s(self.tokens_per_step, self.step_times)

    @property
    def tokens_per_s_median(self) -> float:
        """From the median step time (first step left out): robust to other processes' bursts."""
        times = sorted(self.step_times[1:] if len(self.step_times) > 1 else self.step_times)
        if not times:  # resumed from the last step: nothing trained
            return 0.0
        mid = len(times) // 2
        median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        return self.tokens_per_step / max(median, 1e-12)

    def to_json(self) -> dict:
        return {"losses": self.losses, "first_step": self.first_step, "step_times_s": self.step_times,
                "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_median": self.tokens_per_s_median,
                "first_step_s": self.step_times[0] if self.step_times else None, "wall_s": self.wall_s}


def _callbacks():
    from transformers import TrainerCallback
    from tqdm.auto import tqdm

    class StepRecorder(TrainerCallback):
        """Per-step wall time and logged loss (the Trainer logs every step, the mean over
        ranks), and a progress bar with both."""

        def __init__(self, label: str, tokens_per_step: int, show: bool):
            self.label, self.tokens_per_step, self.show = label, tokens_per_step, show
            self.losses, self.times, self.first_step, self._t0 = [], [], None, None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.label,
                            disable=not (self.show and state.is_world_process_zero), dynamic_ncols=True,
                            file=sys.stderr)

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                if self.first_step is None:
                    self.first_step = state.global_step
                self.losses.append(float(logs["loss"]))
                self.bar.set_postfix(loss=f"{self.losses[-1]:.4f}",
                                     tok_s=f"{steady_tokens_per_s(self.tokens_per_step, self.times):.0f}")
                self.bar.update(1)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return StepRecorder


def train_with_trainer(model: nn.Module, dataset: WindowDataset, args, label: str, *,
                       compile_backend: Optional[str], output_dir: str, world_size: int,
                       resume: Optional[str] = None) -> RunResult:
    """``args.steps`` optimizer steps of a stock Trainer on ``model`` (AdamW ``args.lr``, no
    weight decay, constant schedule, ``args.max_grad_norm``); batch ``args.batch_size`` split
    over the ranks. ``compile_backend``: the model is compiled in place with it (fullgraph)."""
    import transformers
    from transformers.trainer_callback import PrinterCallback

    from kt_ops.hf.trainer import KTAdapterCallback, KTTrainer

    cuda = torch.cuda.is_available()
    per_device = args.batch_size // world_size
    training_args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0,
        max_grad_norm=args.max_grad_norm, logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        seed=args.seed, train_sampling_strategy="sequential", dataloader_num_workers=0,
        dataloader_pin_memory=False, use_cpu=not cuda, ddp_backend=("nccl" if cuda else "gloo") if world_size > 1
        else None)
    recorder = _callbacks()(label, args.batch_size * args.seq_len, show=not args.no_progress)
    if compile_backend is not None:
        model.compile(backend=compile_backend, fullgraph=True)
    injected, dataset = fault_injection(os.environ.get(FAULT_VARIABLE), model, dataset,
                                        training_args.process_index, per_device)
    trainer = KTTrainer(model=model, args=training_args, train_dataset=dataset,
                        callbacks=[recorder, *injected, KTAdapterCallback()])
    trainer.remove_callback(PrinterCallback)  # the progress bar shows loss and tokens/s instead
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    wall = time.perf_counter() - start
    return RunResult(label, recorder.losses, recorder.times, args.batch_size * args.seq_len, wall,
                     recorder.first_step or 1)


FAULT_VARIABLE = "KT_OPS_FINETUNE_FAULT"
FAULTS = ("forward", "kt", "kt-backward", "data", "kill", "kill-in-save")


class _FailingDataset(torch.utils.data.Dataset):
    """``dataset`` whose item number ``fail_at`` (counted in reading order) raises instead."""

    def __init__(self, dataset: torch.utils.data.Dataset, fail_at: int, message: str):
        self.dataset, self.fail_at, self.message, self.items_read = dataset, fail_at, message, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        if self.items_read == self.fail_at:
            raise RuntimeError(self.message)
        self.items_read += 1
        return self.dataset[i]


def fault_injection(spec: Optional[str], model: nn.Module, dataset: WindowDataset, rank: int,
                    items_per_step: int) -> tuple[list, torch.utils.data.Dataset]:
    """The test hook of the module's docstring: ``(callbacks to add, the dataset to train on)``
    (the model is armed in place). No callbacks and ``dataset`` itself without ``spec`` or for
    another rank."""
    if not spec:
        return [], dataset
    what, _, where = spec.partition("@")
    try:
        target_rank, step = (int(v) for v in where.split(":"))
    except ValueError:
        target_rank = step = None
    if what not in FAULTS or step is None or step < 1:
        raise ValueError(f"{FAULT_VARIABLE}={spec!r}: expected WHAT@RANK:STEP with WHAT one of {FAULTS}")
    if rank != target_rank:
        return [], dataset
    from transformers import TrainerCallback

    message = f"injected {what} failure at step {step} on rank {rank} ({FAULT_VARIABLE})"
    armed = {"on": False}

    class Inject(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 != step:
                return
            if what == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if what in ("kt", "kt-backward"):
                from kt_ops import faults
                faults.inject_failure("moe_forward" if what == "kt" else "moe_backward", message)
            # when the failure was armed, for tests that time how fast the job ends after it
            print(f"{FAULT_VARIABLE}: armed at {time.time():.3f}", file=sys.stderr, flush=True)
            armed["on"] = what == "forward"

        def on_save(self, args, state, control, **kwargs):
            if what == "kill-in-save" and state.global_step == step:
                os.kill(os.getpid(), signal.SIGKILL)

    def forward_fault(module, inputs):
        if armed["on"]:
            raise RuntimeError(message)

    if what == "forward":
        model.register_forward_pre_hook(forward_fault)
    if what == "data":
        dataset = _FailingDataset(dataset, (step - 1) * items_per_step, message)
    return [Inject()], dataset
