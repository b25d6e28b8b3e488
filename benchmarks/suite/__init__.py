"""Benchmark suite: ``kt.moe`` against eager PyTorch, ``torch._grouped_mm``, itself in float32,
the ``torch.mm`` ceilings (bf16 and fp32), the memory bandwidth and (when installed)
KTransformers' own kernels, on several MoE shapes, in one run.

Run from the repository root::

    .venv/bin/python -m benchmarks.suite                     # every case below (tens of minutes)
    .venv/bin/python -m benchmarks.suite --quick             # smoke test: tiny shapes, seconds
    .venv/bin/python -m benchmarks.suite --cases tiny,mid --repeats 3 --json out/suite.json
    .venv/bin/python -m benchmarks.suite --cases 'qwen3*' --modes fwd,lora
    .venv/bin/python -m benchmarks.suite --list              # the cases

Cases (``--cases``: comma-separated names or shell patterns; ``decode`` = ``*decode*``, ``all``):

    tiny                         H=256   I=128   E=8    K=2  T=512
    mid                          H=1024  I=512   E=32   K=4  T=2048
    qwen3-30b-a3b-t1024          H=2048  I=768   E=128  K=8  T=1024
    qwen3-30b-a3b-t4096          H=2048  I=768   E=128  K=8  T=4096   (hf-loop skipped, see below)
    deepseek-v2-lite-t2048       H=2048  I=1408  E=64   K=6  T=2048
    qwen3-30b-a3b-decode-t1/4/16 H=2048  I=768   E=128  K=8  T=1, 4, 16
    (``--quick`` runs tiny and tiny-t1 = the tiny shape at T=1; both can also be named.)

Modes (``--modes``, default all three), bf16 weights and activations throughout (but for
``kt.moe-fp32`` and ``mm-ceiling-fp32``, below):

* ``fwd``   forward only, no LoRA, under ``torch.no_grad()`` (inference);
* ``lora``  forward + backward, LoRA rank 8 (alpha 16, scale 2): base frozen, the six LoRA
            tensors and the hidden states require grad;
* ``full``  forward + backward, no LoRA: the three base weights and the hidden states require
            grad.

Routing weights never require grad. Backward is ``y.backward(dy)`` with a fixed random ``dy``;
gradients are set to ``None`` before every step (``zero_grad(set_to_none=True)``). The problem
(weights, hidden states, softmax-top-k routing of random logits) comes from
``benchmarks.common.make_problem`` with ``--seed``, exactly as in ``bench_moe.py``.

Implementations (``--impls`` to pick):

* ``kt.moe``     this library's op (``kt_ops.moe``);
* ``kt.moe-fp32`` the same op on float32 copies of the same problem (routing, hidden states,
                 weights, LoRA tensors and ``dy`` converted; in full mode its fp32 base weights
                 are marked updated in place like the bf16 ones). It shows what bf16 buys over
                 fp32 on this machine (``vs kt fp32``); its errors are against the same bf16
                 reference, so they measure the reference's bf16 rounding (a few 1e-3);
* ``kt.moe-fp8``, ``kt.moe-int8``, ``kt.moe-int4`` the same op, bf16 activations and LoRA, on
                 the problem's base weights quantized once (``kt_ops.quantization``; int4 in
                 groups of 32), fwd and lora modes only (quantized experts are frozen). Their
                 errors include the weights' quantization error; the "Quantized experts" table
                 gives ``x bf16 speed`` = kt.moe's time / theirs;
* ``kt.moe-fp8-fp32`` kt.moe-fp8's weights with float32 activations and LoRA: as
                 ``--reference kt.moe-fp8-fp32`` (fwd and lora modes) the errors of the fp8
                 kernels (kt.moe-fp8, kt-kernel-fp8) leave out the quantization of the weights;
* ``kt.moe-int4-fp32`` the same for kt.moe-int4's weights (``--reference kt.moe-int4-fp32``:
                 kt.moe-int4, kt-kernel-int4);
* ``sorted-mm``  well-written eager PyTorch (``benchmarks.baselines.SortedMoE``): sort the pairs
                 by expert, ``index_select`` the hidden states once, ``split``, one fused
                 gate|up ``mm`` per expert on a fused ``[E, 2I, H]`` copy, SwiGLU, down ``mm``,
                 one ``index_add_``; eager autograd for backward. It is the correctness
                 reference of every other implementation;
* ``grouped-mm`` the same with ``torch._grouped_mm`` (``GroupedMMMoE``; a private op, bf16
                 on CPU): ``n/a`` with the reason if it raises;
* ``hf-loop``    the Hugging Face / PEFT-style per-expert loop of ``bench_moe.py``
                 (``HFLoopMoE``). Skipped on cases marked so (qwen3-30b-a3b-t4096: minutes per
                 mode and a second copy of the weights); ``--loop always`` runs it anyway,
                 ``--loop never`` skips it everywhere;
* ``kt-kernel-fp8`` kt-kernel's ``AMXFP8_SFT`` (frozen E4M3 experts with 128x128 block scales,
                 LoRA) on the very fp8 weights kt.moe-fp8 runs on, lora mode only; it runs on
                 kt-kernel's AMX build and, seen on an AMD Zen 4, its ``avx512_bf16`` build;
* ``kt-kernel-int4`` kt-kernel's ``RAWINT4_SFT`` (signed int4 in groups of 32, bf16 scales,
                 LoRA rank 8) on the very bytes kt.moe-int4 runs on (compressed-tensors'
                 layout, which is kt_ops'), lora mode only;
* ``kt-kernel-int8`` kt-kernel's ``AMXINT8_SFT`` (W8A8) on kt-kernel's own int8 quantization of
                 the bf16 weights (its ``.kt`` files, written by its online quantizer into a
                 temporary directory), lora mode only; compare with ``--reference kt.moe-fp32``
                 (each error then includes its own quantization). kt-kernel crashed with
                 several of its wrappers in one process: run one kt-kernel impl per process;
* ``kt-kernel``  KTransformers' CPU SFT kernels, ``kt-kernel==0.7.2`` (never a dependency: used
                 when ``import kt_kernel`` works, else reported as ``not installed``). Install
                 beside the project with ``pip install --no-deps kt-kernel==0.7.2`` plus numpy,
                 safetensors, pyyaml, packaging and gguf. Driven through
                 ``KTMoEWrapper(..., gpu_experts_mask=None, method="AMXBF16_SFT", mode="sft",
                 lora_rank=..., full_weight_grad=...)`` with ``load_weights_from_tensors``,
                 ``init_lora_weights`` / ``init_full_weight_grad_buffers``, ``forward``,
                 ``backward``; LoRA mode uses rank 8, full and fwd modes ``lora_rank=0,
                 full_weight_grad=True``. Its tensor layouts, LoRA scale (alpha / r) and
                 routing-weight semantics are this project's, so nothing is converted; the
                 header shows which CPU build it loaded (``cpu variant amx`` on AMX machines).
                 Its thread pool is a per-process singleton sized by ``--threads``. Any
                 failure is reported as ``n/a`` with the reason.

Measured in the same run, and how the derived numbers are defined:

* FLOPs: as in ``bench_moe.py`` (multiply-add = 2 FLOPs; P = T·K pairs): F_base = 6·P·H·I,
  F_lora = 6·P·r·(H + I); fwd = F_base, lora = 2·F_base + 3·F_lora, full = 3·F_base.
  GFLOP/s = FLOPs / median time; tokens/s = T / median time.
* ``mm-ceiling`` (a pseudo-implementation timed in the same alternation as the others): the
  base-weight GEMMs of the mode and nothing else, as plain ``torch.mm`` calls in nn.Linear
  layout, at the *real* per-expert row counts of the case's routing, each expert with its own
  weights (so weights stream from memory as they do in the MoE; a single reused weight would sit
  in the L3 cache and overstate small-M rates). Per expert with n rows: fwd: ``[n,H]x[H,2I]``
  and ``[n,I]x[I,H]``; lora adds the input-gradient GEMMs ``[n,H]x[H,I]`` and
  ``[n,2I]x[2I,H]``; full adds also the weight-gradient GEMMs ``[H,n]x[n,I]`` and
  ``[2I,n]x[n,H]``. Its rate (6, 12, 18·P·H·I FLOPs / time) is the ceiling; ``% ceil`` =
  an implementation's GFLOP/s / that rate (the LoRA FLOPs, about 4% at the Qwen3 shape, are
  counted for the implementation but not in the ceiling's GEMMs). No gather, scatter, SwiGLU
  or routing is in the ceiling, so 100% is not reachable, but 60-80% is (docs/benchmarks.md).
  ``mm-ceiling-fp32`` runs exactly these GEMMs on float32 copies of the weights and inputs,
  timed whenever ``mm-ceiling`` is; ``% fp32 ceil`` = GFLOP/s / its rate (for ``kt.moe-fp32``
  the like-for-like figure).
  For context each case header also gives the literal single-GEMM rate: one ``[M,H]x[H,2I]``
  mm repeated on one (cache-warm) weight, M = average rows per expert hit = round(P / experts
  hit), best of three batches.
* Memory bandwidth: a 256 MiB ``copy_`` (far larger than the L3), GB/s = 2·bytes / time (read
  + write), the best of 5 copies (load only ever slows a copy), measured at the start and end
  of the run and again before each case. ``x stream`` (fwd rows) = the forward time / the time
  to read the routed experts' base weights once at the case's rate (experts hit · 3·H·I · 2
  bytes / GB/s): about 1 means bandwidth-bound; it is the figure of merit for the decode cases
  (T = 1, 4, 16), where the weights dominate. Values somewhat below 1 are possible (a pure read
  stream can beat a copy's combined read+write rate). For large T it shows how compute-bound
  the case is. The bytes are the bf16 weights', so a bandwidth-bound ``kt.moe-fp32``, which
  reads twice as many, shows about 2.
* Speedups in the summary (``vs X``) = X's median time / kt.moe's median time (> 1: kt.moe is
  faster); ``vs kt fp32`` = kt.moe-fp32's time / kt.moe's (> 1: bf16 is faster).
* Errors: ``out err`` = ‖y − y_ref‖ / ‖y_ref‖ (Frobenius, in fp32) against ``sorted-mm``'s
  bf16 output from one untimed call per case and mode; ``grad err`` = the largest such error
  over the gradients of the tensors that require grad, both sides converted to fp32. Both
  sides are bf16 (but for kt.moe-fp32), so this is their disagreement (a few 1e-3 expected),
  not an error against exact math.
* Peak memory (``--memory``): ``/proc/self/status`` VmHWM (peak resident set), reset to the
  current RSS by writing ``5`` to ``/proc/self/clear_refs`` right before the measured step, in
  a fresh subprocess started with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every
  allocation of 64 KiB or more separately and returns it on free, so RSS follows live memory
  instead of keeping freed blocks in malloc's arenas). ``tracemalloc`` does not see torch's CPU
  allocations. For each (mode, impl): build the impl, one untimed step, reset its gradients,
  then ``state MiB`` = RSS growth from building it (its own weight copies, such as
  kt.moe-fp32's float32 ones, packed weights, persistent buffers) and ``step MiB`` = VmHWM
  during one step − RSS before it (activations, saved tensors, gradients, workspaces of one
  forward(+backward)). ``--memory case`` (default)
  runs one subprocess per case with the impls one after another (each freed before the next);
  ``--memory impl`` one subprocess per (case, mode, impl), slower and cleanest; ``off`` skips.
  The timing process itself runs with the default allocator settings.

Timing: per case and mode, one untimed correctness call per implementation, ``--warmup``
untimed steps, then ``--repeats`` timed steps (median); the implementations (and the
mm-ceilings) alternate step by step so that all see the same machine load. Decode cases run 4x
``--repeats`` steps (their steps take milliseconds). ``CPU/wall`` is process CPU time / wall
time of the timed steps (near the thread count when nothing else competes). Never run two
benchmarks at once on a small machine: two processes that each use 2 threads slow small ops
10-15x.

Code path: the header and the JSON ``meta`` name the path kt_ops took
(``common.code_path()``): ``cpu_isa`` (the instruction set of its kernels now, ``KT_OPS_CPU_ISA``
can force one) and ``best_cpu_isa``, ``base_gemm_path`` (bf16 base GEMMs through oneDNN's
``onednn_bf16`` or as ``bf16_to_fp32_panels`` on CPUs without native bf16 GEMMs),
``weight_packing``, the environment variables
``KT_OPS_CPU_ISA``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS`` (``env``, value or
``unset``) and which of avx2, fma, avx512f, avx512_bf16, amx_bf16 ``/proc/cpuinfo`` lists
(``cpu_flags``).

``--json PATH`` also writes everything (machine, code path, cases, every row with its step
times, the summary, the notes) as JSON; it is rewritten after each case, so an interrupted run
keeps what finished.

Modules: ``cli`` (arguments, ``main``), ``cases`` (the shapes and their problem), ``impls``
(kt.moe and the eager baselines), ``kt_kernel`` (the optional kt-kernel adapter), ``ceilings``
(mm ceilings, copy bandwidth, single-mm rate), ``run`` (a case and mode: correctness call,
alternating timing, rows), ``memory`` (peak-memory subprocesses), ``report`` (header, tables,
JSON).
"""
