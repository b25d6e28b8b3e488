// Peak loops, one per path: kChains independent accumulators (enough to cover the FMA latency
// times the pipes: Zen 3 needs 4 x 2 = 8, Skylake-SP and Zen 4 8-12), each a register, so the loop is
// the instruction alone. The `asm volatile` keeps the compiler from folding the constant chain.
#include "platform/isa_peak.h"

#include <c10/util/Exception.h>

#include <chrono>

#include "platform/x86_intrinsics.h"

namespace kt {
namespace {

constexpr int kChains = 12;

// Makes a vector opaque to the optimizer. In the build that emulates AVX-512 a zmm value is a
// struct in memory (SIMDe), which no register constraint takes: there through memory (never timed).
#ifdef KT_OPS_EMULATE_AVX512
#define KT_OPAQUE_ZMM(v) asm volatile("" : : "r"(&(v)) : "memory")
#else
#define KT_OPAQUE_ZMM(v) asm volatile("" : "+v"(v))
#endif

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

KT_TARGET_AVX2 double avx2_peak(int64_t iterations) {
  __m256 acc[kChains];
  for (auto& a : acc) a = _mm256_setzero_ps();
  __m256 x = _mm256_set1_ps(1.0f), w = _mm256_set1_ps(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm256_fmadd_ps(x, w, a);
    asm volatile("" : "+x"(x));
  }
  const double s = seconds_since(t0);
  __m256 sum = _mm256_setzero_ps();
  for (auto& a : acc) sum = _mm256_add_ps(sum, a);
  asm volatile("" : : "x"(sum));
  return iterations * kChains * 16.0 / s;
}

KT_TARGET_AVX512 double avx512_peak(int64_t iterations) {
  __m512 acc[kChains];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512 x = _mm512_set1_ps(1.0f), w = _mm512_set1_ps(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm512_fmadd_ps(x, w, a);
    KT_OPAQUE_ZMM(x);
  }
  const double s = seconds_since(t0);
  __m512 sum = _mm512_setzero_ps();
  for (auto& a : acc) sum = _mm512_add_ps(sum, a);
  KT_OPAQUE_ZMM(sum);
  return iterations * kChains * 32.0 / s;
}

KT_TARGET_AVX512_BF16 double avx512_bf16_peak(int64_t iterations) {
  __m512 acc[kChains];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512i pairs = _mm512_set1_epi32(0x3f803f80);  // two bf16 1.0 per lane
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, (__m512bh)pairs, (__m512bh)pairs);
    KT_OPAQUE_ZMM(pairs);
  }
  const double s = seconds_since(t0);
  __m512 sum = _mm512_setzero_ps();
  for (auto& a : acc) sum = _mm512_add_ps(sum, a);
  KT_OPAQUE_ZMM(sum);
  return iterations * kChains * 64.0 / s;  // 16 lanes x 2 products x (multiply + add)
}

}  // namespace

double isa_peak_flops_one_thread(CpuIsa isa, int64_t iterations) {
  TORCH_CHECK(iterations > 0, "isa peak: iterations must be > 0, got ", iterations);
  TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(best_cpu_isa()), "isa peak: this CPU cannot run path ",
              cpu_isa_name(isa), " (best here: ", cpu_isa_name(best_cpu_isa()), ")");
  switch (isa) {
    case CpuIsa::kAvx2: return avx2_peak(iterations);
    case CpuIsa::kAvx512: return avx512_peak(iterations);
    case CpuIsa::kAvx512Bf16: return avx512_bf16_peak(iterations);
    default: TORCH_CHECK(false, "isa peak: the portable path is plain C++ and has no instruction peak; "
                         "ask for avx2, avx512 or avx512_bf16");
  }
}

}  // namespace kt
