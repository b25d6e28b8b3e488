"""The suite's cases (MoE layer shapes), their selection by name or pattern, and the problem
(weights, hidden states, routing) of a case."""
import fnmatch
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List

import torch

from benchmarks.common import make_problem

MODES = ("fwd", "lora", "full")
DTYPE = torch.bfloat16  # of the problem; the fp32 rows convert copies of it
QUICK_CASES = "tiny,tiny-t1"
ALIASES = {"all": "*", "decode": "*decode*"}


@dataclass(frozen=True)
class Case:
    name: str
    H: int
    I: int  # noqa: E741
    E: int
    K: int
    T: int
    decode: bool = False
    skip_loop: str = ""  # why hf-loop is skipped by default ("" = runs)
    quick_only: bool = False

    def shape(self) -> str:
        return f"T={self.T} H={self.H} I={self.I} E={self.E} K={self.K}"


_QWEN = dict(H=2048, I=768, E=128, K=8)
CASES = [
    Case("tiny", H=256, I=128, E=8, K=2, T=512),
    Case("mid", H=1024, I=512, E=32, K=4, T=2048),
    Case("qwen3-30b-a3b-t1024", T=1024, **_QWEN),
    Case("qwen3-30b-a3b-t4096", T=4096, **_QWEN,
         skip_loop="the per-expert loop takes minutes per mode at T=4096 and holds a second "
                   "copy of the weights; --loop always runs it"),
    Case("deepseek-v2-lite-t2048", H=2048, I=1408, E=64, K=6, T=2048),
    Case("qwen3-30b-a3b-decode-t1", T=1, decode=True, **_QWEN),
    Case("qwen3-30b-a3b-decode-t4", T=4, decode=True, **_QWEN),
    Case("qwen3-30b-a3b-decode-t16", T=16, decode=True, **_QWEN),
    Case("tiny-t1", H=256, I=128, E=8, K=2, T=1, decode=True, quick_only=True),
]
CASE_BY_NAME = {c.name: c for c in CASES}


def select_cases(spec: str) -> List[Case]:
    """The cases named by ``spec``: comma-separated names, shell patterns or ALIASES, in the
    order given, each once; ``*`` leaves out the quick-only cases. ValueError names a part
    that matches nothing."""
    out: List[Case] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        pat = ALIASES.get(part, part)
        if pat in CASE_BY_NAME:
            hits = [CASE_BY_NAME[pat]]
        else:
            hits = [c for c in CASES if fnmatch.fnmatchcase(c.name, pat)
                    and (not c.quick_only or pat != "*")]
        if not hits:
            raise ValueError(f"no case matches {part!r}; cases: {', '.join(CASE_BY_NAME)}")
        out += [c for c in hits if c not in out]
    return out


def problem_config(case: Case, args) -> SimpleNamespace:
    """The namespace ``common.make_problem`` and the builders read."""
    return SimpleNamespace(tokens=case.T, hidden=case.H, intermediate=case.I, experts=case.E,
                           topk=case.K, rank=args.rank, torch_dtype=DTYPE, seed=args.seed,
                           lora_alpha=args.lora_alpha, lora_scale=args.lora_scale)


def case_problem(cfg) -> Dict[str, torch.Tensor]:
    """``common.make_problem(cfg)`` plus ``w13``, the fused gate|up weights ``[E, 2I, H]`` that
    sorted-mm, grouped-mm and the mm ceilings use."""
    prob = make_problem(cfg)
    prob["w13"] = torch.cat([prob["gate_proj"], prob["up_proj"]], dim=1)
    return prob


def routing_stats(prob: Dict[str, torch.Tensor], case: Case) -> dict:
    """Pairs per expert (``counts``, min/mean/max), experts hit and rows per expert hit."""
    counts = torch.bincount(prob["topk_ids"].reshape(-1), minlength=case.E)
    hit = int((counts > 0).sum())
    P = case.T * case.K
    return dict(counts=counts.tolist(), experts_hit=hit, pairs=P,
                min=int(counts.min()), max=int(counts.max()), mean=P / case.E,
                avg_rows_per_hit=P / max(hit, 1))
