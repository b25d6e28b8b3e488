// The arithmetic peak of one path's GEMM instruction on this CPU, measured: independent
// multiply-add chains and nothing else in the loop. Benchmarks report kernels as a fraction of it
// (benchmarks/isa_peak_fraction.py); no kernel calls it.
#pragma once

#include <cstdint>

#include "platform/cpu_isa.h"

namespace kt {

// FLOP/s of `isa`'s multiply-add on the calling thread over `iterations` loop trips:
// avx2 vfmadd231ps ymm (16 FLOP), avx512 vfmadd231ps zmm (32), avx512_bf16 vdpbf16ps zmm (64).
// Raises for portable (no instruction of its own) and for a path this CPU cannot run.
double isa_peak_flops_one_thread(CpuIsa isa, int64_t iterations);

}  // namespace kt
