// Peak rate of vdpbf16ps on one core: 12 independent accumulators, nothing else in the loop.
// The upper bound for any AVX512-BF16 GEMM (ours or oneDNN's) on a CPU without AMX.
//
//   g++ -O2 -mavx512f -mavx512bf16 benchmarks/vdpbf16ps_peak.cpp -o /tmp/vdpbf16ps_peak && /tmp/vdpbf16ps_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr int kAccumulators = 12;  // enough independent chains to hide the latency
  constexpr long kIters = 200000000;
  __m512 acc[kAccumulators];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), w = x;  // pairs of bf16 1.0
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, w);
    asm volatile("" : "+v"(x));  // keeps the compiler from folding the loop
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sum = 0;
  for (auto& a : acc) sum += _mm512_reduce_add_ps(a);
  // one vdpbf16ps on zmm: 16 lanes x 2 products x (multiply + add) = 64 FLOP
  std::printf("vdpbf16ps: %.1f GFLOP/s on one thread (checksum %g)\n", kIters * kAccumulators * 64.0 / s / 1e9, sum);
}
