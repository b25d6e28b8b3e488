"""kt_ops.patch_model on random-init tiny transformers models (no downloads).

For each supported architecture (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral,
DeepSeek-V2 with group-limited greedy routing and shared experts, DeepSeek-V3 with sigmoid
scores, e_score_correction_bias, grouped top-k, routed_scaling_factor and shared experts):

* logits of the patched model equal the unpatched model's: fp32 relative error <= 1e-5 with
  two MoE layers (DeepSeek: a dense first layer, first_k_dense_replace=1); bf16 <= 1e-2 with
  the MoE block in the last layer, so that both models route identical inputs (with a
  bf16 MoE layer feeding another one, HF's per-expert bf16 rounding and kt's fp32
  accumulation differ by an ulp and a near-tie route further down can legitimately flip);
* the experts matter (zeroing them changes the logits);
* only the experts module is swapped (kt_ops.hf.experts.KTExperts): the block, its router and
  shared experts are the model's own objects; layout: gate/up split from the fused
  gate_up_proj (gate first), CPU, dtype, requires_grad, tied LoRA A of gate and up, PEFT's
  init; a non-owner rank keeps no expert weights; masked slots (id = E or < 0) add nothing;
* "kt" as a transformers experts implementation (set_experts_implementation("kt"));
* errors: models without transformers experts modules; already patched; non-SiLU; fp16;
* HF gradient checkpointing with kt_ops.checkpoint_context_fn: same gradients, and the CPU
  experts run once per MoE layer per step;
* two gloo ranks (owner_rank=0) equal the single-process patched model.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kt_ops  # noqa: E402
from kt_ops import _kernels  # noqa: E402
from kt_ops.hf.patch import patched_blocks  # noqa: E402
from kt_ops.hf.experts import KTExperts  # noqa: E402

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")
VOCAB, H = 96, 32


def tiny_config(arch: str, *, moe_last_only: bool = False):
    """A tiny random-init config: H=32, vocab 96, 4-8 experts, top-2; two MoE layers (or,
    with ``moe_last_only``, one MoE layer, the last, after dense ones)."""
    common = dict(vocab_size=VOCAB, hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.15, max_position_embeddings=64)
    if arch in ("qwen3_moe", "qwen2_moe"):
        kw = dict(common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_experts=8,
                  num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0] if moe_last_only else [])
        if arch == "qwen3_moe":
            return transformers.Qwen3MoeConfig(**kw, head_dim=8, norm_topk_prob=True)
        return transformers.Qwen2MoeConfig(**kw, shared_expert_intermediate_size=24, norm_topk_prob=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=8, intermediate_size=16,
                                          num_hidden_layers=1 if moe_last_only else 2,
                                          num_local_experts=4, num_experts_per_tok=2)
    mla = dict(common, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
               first_k_dense_replace=2 if moe_last_only else 1, kv_lora_rank=16, qk_rope_head_dim=4,
               qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
               n_group=4, topk_group=2)
    if arch == "deepseek_v2":
        return transformers.DeepseekV2Config(**mla, q_lora_rank=None, topk_method="group_limited_greedy",
                                             routed_scaling_factor=1.5)
    return transformers.DeepseekV3Config(**mla, q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True)


def tiny_model(arch: str, *, dtype=torch.float32, seed: int = 0, moe_last_only: bool = False):
    """A random-init tiny causal LM (eval mode); DeepSeek-V3's correction bias made nonzero."""
    config = tiny_config(arch, moe_last_only=moe_last_only)
    torch.manual_seed(seed)
    model = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))(config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(-0.1, 0.1)
    return model.to(dtype).eval()


def input_ids(seed: int = 0, batch: int = 2, seq: int = 7):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:  # e.g. the 0-element grad anchor's gradient
        return 0.0 if a.shape == b.shape else float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def moe_block_names(model):
    return [n for n, _ in patched_blocks(model)]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_fp32(arch):
    model = tiny_model(arch)
    ids = input_ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    patched = kt_ops.patch_model(copy.deepcopy(model))
    assert len(moe_block_names(patched)) == 2
    with torch.no_grad():
        out = patched(input_ids=ids).logits
        assert rel_err(out, ref) <= 1e-5
        # the experts matter: without them the logits change a lot
        for _, block in patched_blocks(patched):
            block.experts.down_proj.zero_()
        assert rel_err(patched(input_ids=ids).logits, ref) > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_bf16(arch):
    model = tiny_model(arch, dtype=torch.bfloat16, moe_last_only=True)
    ids = input_ids(1)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    patched = kt_ops.patch_model(copy.deepcopy(model))
    (block,) = [b for _, b in patched_blocks(patched)]
    assert block.experts.gate_proj.dtype == torch.bfloat16
    with torch.no_grad():
        out = patched(input_ids=ids).logits
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_experts_swapped_block_untouched(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    blocks = {n: m for n, m in model.named_modules() if hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj")}
    before = {n: (type(b), dict(b.named_children()), b.experts.gate_up_proj.detach().clone(),
                  b.experts.down_proj.detach().clone(), b.experts) for n, b in blocks.items()}
    reference = copy.deepcopy(model)
    patched = kt_ops.patch_model(model, lora_rank=4, lora_alpha=8)
    assert patched is model and moe_block_names(patched) == list(blocks)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    for name, (cls, children, gate_up, down, old_experts) in before.items():
        block, hf = patched.get_submodule(name), reference.get_submodule(name)
        # the model's own block, router and shared experts, as they were; only `experts` is new
        assert type(block) is cls and isinstance(block.experts, KTExperts)
        for child, module in children.items():
            if child != "experts":
                assert getattr(block, child) is module, child
        assert old_experts.gate_up_proj is None and old_experts.down_proj is None  # dropped
        kt = block.experts
        # expert weights: gate = first half of gate_up_proj, on the CPU, frozen
        I = gate_up.shape[1] // 2
        assert torch.equal(kt.gate_proj, gate_up[:, :I]) and torch.equal(kt.up_proj, gate_up[:, I:])
        assert torch.equal(kt.down_proj, down)
        for p in (kt.gate_proj, kt.up_proj, kt.down_proj):
            assert p.device.type == "cpu" and p.dtype == dtype and not p.requires_grad and p.is_contiguous()
        assert not hasattr(kt, "gate")  # no router of its own: the block routes
        # LoRA: gate/up A tied (PEFT's single LoRA on the fused gate_up_proj), PEFT's init
        E, r = kt.num_experts, 4
        assert kt.gate_lora_a is kt.up_lora_a and kt.lora_scale == 2.0
        assert kt.gate_lora_a.shape == (E, r, H) and kt.down_lora_a.shape == (E, r, I)
        assert kt.gate_lora_b.shape == kt.up_lora_b.shape == (E, I, r) and kt.down_lora_b.shape == (E, H, r)
        for a, fan_in in ((kt.gate_lora_a, H), (kt.down_lora_a, I)):
            assert a.requires_grad and 0 < a.abs().max() <= fan_in ** -0.5
        for b in (kt.gate_lora_b, kt.up_lora_b, kt.down_lora_b):
            assert b.requires_grad and not b.any()
        with torch.no_grad():
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            out, ref = block(x), hf(x)
            out, ref = (out[0], ref[0]) if isinstance(out, tuple) else (out, ref)
            assert rel_err(out, ref) <= tol  # B = 0: the block equals the original
    assert patched.model.layers[-1].mlp.experts.lora_rank == 4


def test_masked_slots_contribute_nothing():
    """Expert ids equal to num_experts or negative (slots the model masks) add nothing and get
    no routing-weight gradient, as in transformers' experts loop, which skips them."""
    model = tiny_model("qwen3_moe")
    experts = copy.deepcopy(model.model.layers[0].mlp.experts)
    experts.config._experts_implementation = "eager"
    kt_experts = kt_ops.patch_model(model).model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, H, generator=g)
    E = kt_experts.num_experts
    ids = torch.randint(0, E, (6, 2), generator=g)
    ids[1, 0], ids[3, 1], ids[4, 0] = E, -1, E
    w = torch.rand(6, 2, generator=g, requires_grad=True)
    out = kt_experts(x, ids, w)
    ref = experts(x, torch.where(ids < 0, torch.full_like(ids, E), ids), w)  # the eager loop skips id == E
    assert rel_err(out, ref) <= 1e-6
    out.sum().backward()
    assert w.grad[1, 0] == 0 and w.grad[3, 1] == 0 and w.grad[4, 0] == 0 and w.grad[0].abs().sum() > 0


def test_kt_registered_as_a_transformers_experts_implementation():
    """``set_experts_implementation("kt")``: the unchanged experts modules run kt.moe on their
    own weights; same logits and gradients as the eager experts."""
    model = tiny_model("mixtral")
    kt_model = copy.deepcopy(model)
    kt_ops.hf.register_kt_experts()
    kt_model.set_experts_implementation("kt")
    model.set_experts_implementation("eager")
    ids = input_ids()
    _kernels.calls.clear()
    out = kt_model(input_ids=ids, labels=ids)
    assert _kernels.calls["moe_forward"] == 2  # two MoE layers, each through kt.moe
    ref = model(input_ids=ids, labels=ids)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(kt_model.named_parameters(), model.parameters()):
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= 1e-5, name


_FRESH_PROCESS_KT_EXPERTS = r"""
import sys, torch
if sys.argv[1] == "transformers-first":
    import transformers
import kt_ops
from kt_ops import _kernels
assert (sys.argv[1] == "transformers-first") == ("transformers" in sys.modules), "import kt_ops imported transformers"
import transformers
config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_experts=8,
    num_experts_per_tok=2, initializer_range=0.15)
torch.manual_seed(0)
transformers.Qwen3MoeForCausalLM(config).save_pretrained(sys.argv[2])
ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
eager = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2], experts_implementation="eager").eval()
kt = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2], experts_implementation="kt").eval()
switched = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
switched.set_experts_implementation("kt")
with torch.no_grad():
    ref = eager(input_ids=ids).logits
    _kernels.calls.clear()
    for model in (kt, switched):
        err = float((model(input_ids=ids).logits - ref).abs().max() / ref.abs().max())
        assert err <= 1e-5, err
    assert _kernels.calls["moe_forward"] == 4, dict(_kernels.calls)  # 2 models x 2 MoE layers through kt.moe
print("ok")
"""


@pytest.mark.parametrize("order", ["kt_ops-first", "transformers-first"])
def test_kt_experts_implementation_after_import_kt_ops(order, tmp_path):
    """In a fresh process, ``import kt_ops`` (before or after transformers, without importing it
    itself) is all ``from_pretrained(..., experts_implementation="kt")`` and
    ``set_experts_implementation("kt")`` need: both run kt.moe, logits equal to eager experts."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_KT_EXPERTS, order, str(tmp_path / "model")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_train_base_and_deepcopy():
    patched = kt_ops.patch_model(tiny_model("qwen3_moe"), train_base=True)
    kt = patched.model.layers[0].mlp.experts
    assert kt.gate_proj.requires_grad and kt.down_proj.requires_grad and kt.lora_rank == 0
    clone = copy.deepcopy(patched)
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(clone(input_ids=ids).logits, patched(input_ids=ids).logits)


def test_mixtral_jitter_in_training():
    model = tiny_model("mixtral")
    model.config.router_jitter_noise = 0.1
    for layer in model.model.layers:
        layer.mlp.jitter_noise = 0.1
    patched = kt_ops.patch_model(copy.deepcopy(model))
    assert patched.model.layers[0].mlp.jitter_noise == 0.1
    ids = input_ids()
    outs = []
    for m in (model, patched):
        m.train()
        torch.manual_seed(7)
        with torch.no_grad():
            outs.append(m(input_ids=ids).logits)
    assert rel_err(outs[1], outs[0]) <= 1e-5


def test_non_owner_rank_drops_the_experts(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tiny_model("deepseek_v3")
    old = [m.experts for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"]
    patched = kt_ops.patch_model(model, lora_rank=4, owner_rank=1)
    for _, block in patched_blocks(patched):
        kt = block.experts
        assert not kt.is_owner and not hasattr(kt, "gate_proj") and not hasattr(kt, "gate_lora_a")
        assert sorted(n for n, p in kt.named_parameters()) == ["expert_grad_norm", "grad_anchor"]
        assert kt.grad_anchor.numel() == 0 and kt.expert_grad_norm.numel() == 1
    assert all(o.gate_up_proj is None and o.down_proj is None for o in old)
    names = [n for n, _ in patched.named_parameters()]
    assert not any(".experts." in n and not n.endswith((".experts.grad_anchor", ".experts.expert_grad_norm"))
                   for n in names)
    assert any(n.endswith("mlp.gate.weight") for n in names) and any("shared_experts" in n for n in names)


def test_rng_stream_is_the_same_on_owner_and_non_owner(monkeypatch):
    """Ranks stay in RNG step: patching draws the same numbers whether or not a rank owns."""
    def draws_after_patch(owner_rank):
        model = tiny_model("qwen3_moe")
        torch.manual_seed(123)
        kt_ops.patch_model(model, lora_rank=2, owner_rank=owner_rank)
        return torch.rand(4)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torch.equal(draws_after_patch(0), draws_after_patch(1))


def test_errors():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"no transformers experts module found.*model_type='llama'"
                                         r".*@use_experts_implementation"):
        kt_ops.patch_model(llama)
    patched = kt_ops.patch_model(tiny_model("qwen3_moe"))
    with pytest.raises(ValueError, match="already patched"):
        kt_ops.patch_model(patched)
    with pytest.raises(ValueError, match="lora_rank must be an int >= 0"):
        kt_ops.patch_model(tiny_model("qwen3_moe"), lora_rank=-1)
    with pytest.raises(ValueError, match="lora_alpha"):
        kt_ops.patch_model(tiny_model("qwen3_moe"), lora_alpha="8")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        kt_ops.patch_model("Qwen/Qwen3-30B-A3B")
    gelu = tiny_config("qwen3_moe")
    gelu.hidden_act = "gelu"
    model = transformers.Qwen3MoeForCausalLM(gelu)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: Qwen3MoeExperts's gating \(activation "
                                         r"GELUActivation\) is not act\(gate\)·up.*SwiGLU"):
        kt_ops.patch_model(model)
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"  # nothing changed
    with pytest.raises(ValueError, match="expert weights are torch.float16"):
        kt_ops.patch_model(tiny_model("mixtral", dtype=torch.float16))
    with pytest.raises(ValueError, match=r"owner_rank must be in \[0, 1\)"):
        kt_ops.patch_model(tiny_model("mixtral"), owner_rank=1)


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_gradient_checkpointing(arch):
    patched = kt_ops.patch_model(tiny_model(arch), lora_rank=4, lora_alpha=8)
    with torch.no_grad():
        for name, p in patched.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(std=0.2)
    patched.train()
    ids = input_ids()
    patched(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    ref = {n: p.grad.clone() for n, p in patched.named_parameters() if p.grad is not None}
    assert any("lora" in n for n in ref) and any(n.endswith("mlp.gate.weight") for n in ref)
    # transformers' deprecated alias, on purpose (the docs and the other tests use
    # activation_checkpointing_enable(activation_checkpointing_kwargs=...)): both must work
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": kt_ops.checkpoint_context_fn})
    n_moe = len(patched_blocks(patched))
    for _ in range(2):
        patched.zero_grad(set_to_none=True)
        _kernels.calls.clear()
        patched(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        assert _kernels.calls["moe_forward"] == n_moe and _kernels.calls["moe_backward"] == n_moe
        grads = {n: p.grad for n, p in patched.named_parameters() if p.grad is not None}
        assert grads.keys() == ref.keys()
        for name, g in grads.items():
            assert rel_err(g, ref[name]) <= 1e-6, name


# ---------------------------------------------------------------------------------------------
# Two gloo ranks

def _two_rank_worker(rank, world_size):
    import kt_ops as kt
    from kt_ops.hf.patch import patched_blocks as blocks

    model = tiny_model("qwen3_moe", seed=5)
    kt.patch_model(model, lora_rank=4, lora_alpha=8, owner_rank=0)
    _set_lora_b(model)
    ids = input_ids(seed=20 + rank, seq=5 + 2 * rank)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "grads": grads,
            "expert_params": sum(p.numel() for _, b in blocks(model) for n, p in b.experts.named_parameters()
                                 if n not in ("grad_anchor", "expert_grad_norm"))}


def _set_lora_b(model):
    """LoRA B nonzero, deterministically per MoE block (on the owner: only it has LoRA)."""
    for index, (_, block) in enumerate(patched_blocks(model)):
        kt = block.experts
        if kt.is_owner:
            g = torch.Generator().manual_seed(100 + index)
            with torch.no_grad():
                for name in ("gate_lora_b", "up_lora_b", "down_lora_b"):
                    getattr(kt, name).copy_(0.2 * torch.randn(getattr(kt, name).shape, generator=g))


def test_two_ranks_equal_single_process():
    """Each rank runs its own batch through the patched model (experts on rank 0 only):
    logits and non-expert gradients equal the single-process model's on that batch, and the
    owner's expert LoRA gradients are the average of the per-batch gradients (DDP semantics)."""
    from distributed_harness import check_all_ok, run_ranks

    results = check_all_ok(run_ranks(_two_rank_worker, 2, timeout_s=150))
    assert results[0]["expert_params"] > 0 and results[1]["expert_params"] == 0
    model = tiny_model("qwen3_moe", seed=5)
    kt_ops.patch_model(model, lora_rank=4, lora_alpha=8)
    _set_lora_b(model)
    ref_grads = {}
    for rank in range(2):
        ids = input_ids(seed=20 + rank, seq=5 + 2 * rank)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        assert rel_err(out.logits, results[rank]["logits"]) <= 1e-5
        out.loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                ref_grads.setdefault(n, []).append(p.grad.clone())
    assert any("lora" in n for n in ref_grads)
    for n, (g0, g1) in ref_grads.items():
        if ".experts." in n and not n.endswith("grad_anchor"):
            assert n not in results[1]["grads"]
            assert rel_err(results[0]["grads"][n], (g0 + g1) / 2) <= 1e-5, n
        else:
            assert rel_err(results[0]["grads"][n], g0) <= 1e-5, n
            assert rel_err(results[1]["grads"][n], g1) <= 1e-5, n
