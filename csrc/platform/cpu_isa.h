// Runtime choice of the instruction set the hand-written CPU kernels use.
//
// The extension is compiled for baseline x86-64; the SIMD kernels are separate functions
// compiled with __attribute__((target(...))) and only called when the CPU (and the OS, for
// the AVX-512 register state) supports them, so the library never dies with an illegal
// instruction. The environment variable KT_OPS_CPU_ISA (portable | avx2 | avx512 |
// avx512_bf16 | auto) forces a path at import; kt::_set_cpu_isa changes it at run time (tests
// use it to cover every path on one machine). Asking for a path the CPU lacks raises.
#pragma once

#include <string>

namespace kt {

enum class CpuIsa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// The best path this CPU supports.
CpuIsa best_cpu_isa();

// The path the kernels use now (best_cpu_isa() unless forced).
CpuIsa active_cpu_isa();

const char* cpu_isa_name(CpuIsa isa);

// Parses a name ("auto" = best); throws ValueError naming `what` for an unknown name and
// RuntimeError when this CPU cannot run the path.
CpuIsa parse_cpu_isa(const std::string& name, const char* what);

void set_active_cpu_isa(CpuIsa isa);

// True when bf16 GEMMs on the active path are oneDNN's native ones (and may be pre-packed,
// see packed_weights.h); false where kt_ops converts bf16 panels to float32 (base_gemm.h).
inline bool native_bf16_gemms() { return active_cpu_isa() == CpuIsa::kAvx512Bf16; }

// True when oneDNN's cap on its instruction set (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA) leaves
// out AMX (AVX512_CORE_BF16 and below: emulating a CPU without AMX on one that has it), so that
// kt_ops leaves its AMX kernels out too (amx_gemm.h).
bool onednn_cap_excludes_amx();

// Whether the CPU has AVX512-VBMI (true in the test build that emulates AVX-512).
bool cpu_has_avx512_vbmi();

// Whether the CPU has AVX512-VNNI (true in the test build that emulates AVX-512).
bool cpu_has_avx512_vnni();

// Functions compiled for one path. AVX-512 implies AVX2 and FMA on every CPU that has it.
#define KT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#ifndef KT_OPS_EMULATE_AVX512
#define KT_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define KT_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))
// Kernels of the avx512_bf16 path that also need AVX512-VBMI's byte permutes (every CPU with
// AVX512-BF16 but Cooper Lake has it): called only where cpu_has_avx512_vbmi().
#define KT_TARGET_AVX512_BF16_VBMI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma")))
// Kernels of the avx512 paths that also need AVX512-VNNI's integer dot products: called only where
// cpu_has_avx512_vnni().
#define KT_TARGET_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))
#else
// The test build that emulates AVX-512 (x86_intrinsics.h): the AVX-512 kernels compile for AVX2, so that
// the compiler emits no AVX-512 instruction of its own in them.
#define KT_TARGET_AVX512 KT_TARGET_AVX2
#define KT_TARGET_AVX512_BF16 KT_TARGET_AVX2
#define KT_TARGET_AVX512_BF16_VBMI KT_TARGET_AVX2
#define KT_TARGET_AVX512_VNNI KT_TARGET_AVX2
#endif

}  // namespace kt
