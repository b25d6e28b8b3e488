"""kt_ops.expert_init.draw_experts: one shard's experts equal the same experts of one draw of all
of them, for randn and rand (float32; rand also float64, as patch_model draws LoRA A), sizes that are and are not multiples of 16, under 16 values, and
chunks smaller than the tensor (the chunk size is patched down to exercise the boundaries)."""
import pytest
import torch

from kt_ops import expert_init
from kt_ops.expert_init import draw_experts


@pytest.mark.parametrize("chunk", [16, 48, 1 << 22])
@pytest.mark.parametrize("shape", [(4, 12, 16), (3, 5, 7), (5, 1, 3), (2, 3, 3), (7, 9, 11), (1, 4, 4)])
@pytest.mark.parametrize("sampler,dtype", [(torch.randn, torch.float32), (torch.rand, torch.float32),
                                           (torch.rand, torch.float64)], ids=["randn", "rand", "rand-f64"])
def test_shards_equal_the_full_draw(sampler, dtype, shape, chunk, monkeypatch):
    monkeypatch.setattr(expert_init, "_CHUNK", chunk)
    full = sampler(shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    after_full = torch.Generator().manual_seed(3)
    sampler(shape, generator=after_full, dtype=dtype)
    E = shape[0]
    for start in range(E + 1):
        for stop in range(start, E + 1):
            g = torch.Generator().manual_seed(3)
            part = draw_experts(sampler, shape, g, range(start, stop), dtype=dtype)
            assert torch.equal(part, full[start:stop]), (start, stop)
            # the generator ends where the full draw leaves it: later draws agree too
            assert torch.equal(torch.rand(5, generator=g), torch.rand(5, generator=_copy(after_full)))


def _copy(g):
    c = torch.Generator()
    c.set_state(g.get_state())
    return c
