// The AVX-512 kernels of quant_gemv_nt (quant_gemv.h): the AVX2 kernels of quant_gemv.cpp step
// for step with 16 lanes instead of 8, so each decode instruction handles twice the values:
//   fp8 / int8: each byte sign-extended to 32 bits (vpmovsxbd), then fp8's shift-and-mask into
//     float32 bit patterns (the value / 2^120, x carrying the block scales and 2^120) or int8's
//     vcvtdq2ps; RJ weight rows per pass, 64 columns per step and one 32-column step where
//     K % 64 = 32, so both paths leave the same columns (K % 32) to the shared fix-ups;
//   int4: 16 bytes zero-extended to 32 bits give 32 columns, the low nibbles the even ones and
//     the high nibbles the odd ones (x permuted alike per 32 columns); the stored +8 removed
//     through each group's sum of x.
// fp8 bands whose scaled x would overflow, the K % 32 tail columns and rows holding a NaN code
// go through the same code as on the AVX2 path (quant_gemv_internal.h).
#include "ops/quant_gemv_internal.h"

namespace kt {
namespace qgemv {
namespace {

KT_TARGET_AVX512 inline __m512 decode_fp8x16_bits(const uint8_t* p) {
  const __m512i d = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(d, 20), _mm512_set1_epi32(int32_t(0x87f00000))));
}

KT_TARGET_AVX512 inline __m512 decode_int8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

struct Fp8Bits {
  static constexpr bool kCheckNan = true;
  KT_TARGET_AVX512 static __m512 decode(const uint8_t* p) { return decode_fp8x16_bits(p); }
};
struct Int8Values {
  static constexpr bool kCheckNan = false;
  KT_TARGET_AVX512 static __m512 decode(const uint8_t* p) { return decode_int8x16(p); }
};

// The largest of 32 bytes with their sign bit cleared, folded into `seen` (a NaN code is 0x7f).
KT_TARGET_AVX512 inline __m256i max_magnitude32(const uint8_t* p, __m256i seen) {
  return _mm256_max_epu8(seen, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                                _mm256_set1_epi8(0x7f)));
}

// Q vectors of 16 columns from column c of RJ weight rows against M rows of x, into the chains
// part[m][j][q % C].
template <class Decoder, int M, int RJ, int C, int Q>
KT_TARGET_AVX512 inline void dot_step(const float* x, int64_t K, const uint8_t* row, int64_t ld, int64_t c,
                                      __m512 (&part)[M][RJ][C], __m256i& magnitude) {
  if constexpr (Decoder::kCheckNan) {
    KT_UNROLL for (int j = 0; j < RJ; ++j) KT_UNROLL for (int h = 0; h < Q / 2; ++h)
      magnitude = max_magnitude32(row + j * ld + c + 32 * h, magnitude);
  }
  KT_UNROLL for (int q = 0; q < Q; ++q) {
    __m512 xv[M];
    KT_UNROLL for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + c + 16 * q);
    KT_UNROLL for (int j = 0; j < RJ; ++j) {
      const __m512 v = Decoder::decode(row + j * ld + c + 16 * q);
      KT_UNROLL for (int m = 0; m < M; ++m) part[m][j][q % C] = _mm512_fmadd_ps(xv[m], v, part[m][j][q % C]);
    }
  }
}

// dot_rows of quant_gemv.cpp: RJ weight rows r..r+RJ at once against M rows of x over the
// first K32 columns, each x vector loaded once for the RJ rows; prefetch_rows rows from `ahead`
// prefetched.
template <class Decoder, int M, int RJ, int C>
KT_TARGET_AVX512 inline void dot_rows(const float* x, int64_t K, int64_t K32, const uint8_t* row, int64_t ld,
                                      const uint8_t* ahead, int64_t prefetch_rows, float (&sums)[M][RJ],
                                      bool* nan) {
  __m512 part[M][RJ][C];
  KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < RJ; ++j) KT_UNROLL for (int i = 0; i < C; ++i)
    part[m][j][i] = _mm512_setzero_ps();
  __m256i magnitude = _mm256_setzero_si256();
  int64_t c = 0;
  for (; c + 64 <= K32; c += 64) {
    KT_UNROLL for (int j = 0; j < RJ; ++j) {
      if (j < prefetch_rows) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * ld + c), _MM_HINT_T0);
    }
    dot_step<Decoder, M, RJ, C, 4>(x, K, row, ld, c, part, magnitude);
  }
  if (c < K32) dot_step<Decoder, M, RJ, C, 2>(x, K, row, ld, c, part, magnitude);  // K32 % 64 = 32
  if constexpr (Decoder::kCheckNan) {
    *nan = _mm256_movemask_epi8(_mm256_cmpeq_epi8(magnitude, _mm256_set1_epi8(0x7f))) != 0;
  }
  KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < RJ; ++j) {
    __m512 t = part[m][j][0];
    KT_UNROLL for (int i = 1; i < C; ++i) t = _mm512_add_ps(t, part[m][j][i]);
    sums[m][j] = _mm512_reduce_add_ps(t);
  }
}

// dot_rows as the pass of dot_row_range (quant_gemv_internal.h).
template <class Decoder>
struct Avx512Pass {
  template <int M, int RJ, int C>
  KT_TARGET_AVX512 static void run(const float* x, int64_t K, int64_t K32, const uint8_t* row, int64_t ld,
                                   const uint8_t* ahead, int64_t prefetch_rows, float (&sums)[M][RJ], bool* nan) {
    dot_rows<Decoder, M, RJ, C>(x, K, K32, row, ld, ahead, prefetch_rows, sums, nan);
  }
};

// ---- int4 ---------------------------------------------------------------------------------------

// 32 columns from 16 bytes: lo = the even columns c, c+2, .., c+30 (low nibbles), hi = the odd
// ones, each q + 8 in 0..15.
KT_TARGET_AVX512 inline void decode_int4x32(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(0x0f)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
}

template <int M>
constexpr int kInt4TotalChains = M == 1 ? 4 : M == 2 ? 2 : 1;

// One group of G columns into chain J of each x row's total (quant_gemv.cpp's int4_group).
template <int M, int C, int G, int J>
KT_TARGET_AVX512 inline void int4_group(const float* x, int64_t K, const uint8_t* p, const float* s,
                                        const float* neg_sums, int64_t groups, __m512 (&total)[M][C]) {
  __m512 part[M][2];
  KT_UNROLL for (int m = 0; m < M; ++m) {
    part[m][0] = _mm512_loadu_ps(neg_sums + m * groups * 16);
    part[m][1] = _mm512_setzero_ps();
  }
  KT_UNROLL for (int c = 0; c < G; c += 32) {
    __m512 lo, hi;
    decode_int4x32(p + c / 2, lo, hi);
    KT_UNROLL for (int m = 0; m < M; ++m) {
      part[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + c), lo, part[m][0]);
      part[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + c + 16), hi, part[m][1]);
    }
  }
  const __m512 sv = _mm512_set1_ps(*s);
  KT_UNROLL for (int m = 0; m < M; ++m) total[m][J] = _mm512_fmadd_ps(sv, _mm512_add_ps(part[m][0], part[m][1]), total[m][J]);
}

template <bool Bf16>
KT_TARGET_AVX512 inline const float* row_scales(const void* scales, int64_t s0, int64_t groups, float* buffer) {
  if constexpr (!Bf16) {
    return static_cast<const float*>(scales) + s0;
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(scales) + s0;
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) _mm512_storeu_ps(buffer + g, simd::load16_bf16(src + g));
    for (; g < groups; ++g) buffer[g] = simd::bf16_to_float(src[g]);
    return buffer;
  }
}

template <int M, int G, bool Bf16>
KT_TARGET_AVX512 void gemv_int4_groups(const float* x, const float* neg_sums, const WeightMatrix& w,
                                       float* scale_buffer, float* out) {
  constexpr int C = kInt4TotalChains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const float* s = row_scales<Bf16>(scales, r * groups, groups, scale_buffer);
    __m512 total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = _mm512_setzero_ps();
    int64_t gi = 0;
    for (; gi + C <= groups; gi += C) {
      if (row_ahead != nullptr) prefetch_lines(row_ahead, gi * (G / 2), (gi + C) * (G / 2));
      const float* xg = x + gi * G;
      const float* ng = neg_sums + gi * 16;
      const uint8_t* pg = row + gi * (G / 2);
      int4_group<M, C, G, 0>(xg, K, pg, s + gi, ng, groups, total);
      if constexpr (C > 1) int4_group<M, C, G, (C > 1)>(xg + G, K, pg + G / 2, s + gi + 1, ng + 16, groups, total);
      if constexpr (C > 2) {
        int4_group<M, C, G, 2 * (C > 2)>(xg + 2 * G, K, pg + G, s + gi + 2, ng + 32, groups, total);
        int4_group<M, C, G, 3 * (C > 2)>(xg + 3 * G, K, pg + 3 * G / 2, s + gi + 3, ng + 48, groups, total);
      }
    }
    for (; gi < groups; ++gi) {
      int4_group<M, C, G, 0>(x + gi * G, K, row + gi * (G / 2), s + gi, neg_sums + gi * 16, groups, total);
    }
    KT_UNROLL for (int m = 0; m < M; ++m) {
      __m512 sum = total[m][0];
      KT_UNROLL for (int j = 1; j < C; ++j) sum = _mm512_add_ps(sum, total[m][j]);
      out[m * R + r] = _mm512_reduce_add_ps(sum);
    }
  }
}

// The AVX-512 kernels for the drivers of quant_gemv_internal.h.
struct Avx512Kernels {
  using Fp8Pass = Avx512Pass<Fp8Bits>;
  using Int8Pass = Avx512Pass<Int8Values>;
  static constexpr int kLanes = 16;
  template <int M, int G, bool Bf16>
  static void int4_groups(const float* x, const float* neg_sums, const WeightMatrix& w, float* scale_buffer,
                          float* out) {
    gemv_int4_groups<M, G, Bf16>(x, neg_sums, w, scale_buffer, out);
  }
};

// ---- int4 on bf16 activations (AVX512-BF16) -------------------------------------------------
//
// The float32 kernel above spends two conversions and two FMAs per 32 weights. Here 64 weights
// (32 bytes) are one widening (vpmovzxbw), one shift, two table lookups (vpermw) and two
// vdpbf16ps: the low nibbles index the table as they are (bits 5-7 of a byte are ignored by
// vpermw's 32-entry index and bit 4 selects the table's copy, so the table holds q - 8 twice),
// the high nibbles after a shift. The low-nibble vector then holds the even columns of the 64
// and the high-nibble vector the odd ones, so x is reordered to match once per call
// (bf16_x_evens_odds). The products are exact, the sums float32 (vdpbf16ps also flushes bf16
// denormals of x, |x| < 2^-126). A last 32 columns (K % 64 = 32) go through the 32-column step
// on x as it is. Against the previous kernel (one lookup per 32 columns on x as it is; both
// prefetching the rows ahead), Intel Xeon with AMX: one thread, one x row, [768, 2048]
// (benchmarks.quant_gemv): 10% more weights/s from cache, 1-4% from memory; kt.moe int4
// decode on 2 threads (benchmarks.decode_formats, which there is bound by these instructions):
// 5% faster at T = 1 and 16. On Zen 4 the 32-column kernel had been 1.2-1.3x the float32
// kernel's speed (kt.moe int4 decode from 1.3-1.7x to 2.0-2.4x bf16's). The rows ahead are
// prefetched (kPrefetchAheadBytes): on that Xeon this doubled the GEMV's speed from memory
// (6.9 -> 15 G weights/s, one thread).

// Chains of independent sums per x row, enough to cover vdpbf16ps's latency.
template <int M>
constexpr int kBf16Chains = M == 1 ? 4 : M == 2 ? 2 : 1;

// x [M, K] bf16 (row stride ldx) as each 64 columns' 32 evens then 32 odds, into xp [M, K]; the
// last K % 64 columns are copied as they are.
KT_TARGET_AVX512_BF16 void bf16_x_evens_odds(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp) {
  alignas(64) uint16_t even_idx[32], odd_idx[32];
  for (int i = 0; i < 32; ++i) even_idx[i] = uint16_t(2 * i), odd_idx[i] = uint16_t(2 * i + 1);
  const __m512i ie = _mm512_load_si512(even_idx), io = _mm512_load_si512(odd_idx);
  const int64_t K64 = K / 64 * 64;
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* src = x + m * ldx;
    uint16_t* dst = xp + m * K;
    for (int64_t c = 0; c < K64; c += 64) {
      const __m512i a = _mm512_loadu_si512(src + c), b = _mm512_loadu_si512(src + c + 32);
      _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(a, ie, b));
      _mm512_storeu_si512(dst + c + 32, _mm512_permutex2var_epi16(a, io, b));
    }
    std::copy(src + K64, src + K, dst + K64);
  }
}

// 32 columns c.. of a row against x as it is (pairs in column order: byte j's low nibble is
// column 2j, its high nibble 2j + 1, one dword of the lookup index), into part.
template <int M>
KT_TARGET_AVX512_BF16 inline void int4_bf16_step32(const uint16_t* x, int64_t ldx, const uint8_t* row, int64_t c,
                                                   __m512i table, __m512 (&part)[M]) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
  const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000f000f), 0xa8);
  const __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(idx, table);
  KT_UNROLL for (int m = 0; m < M; ++m) {
    part[m] = _mm512_dpbf16_ps(part[m], wv, (__m512bh)_mm512_loadu_si512(x + m * ldx + c));
  }
}

// 64 columns c.. of a row against xp (bf16_x_evens_odds' order), into part.
template <int M>
KT_TARGET_AVX512_BF16 inline void int4_bf16_step64(const uint16_t* xp, int64_t K, const uint8_t* row, int64_t c,
                                                   __m512i table, __m512 (&part)[M][2]) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c / 2)));
  const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(b, table);                        // even columns
  const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);  // odd columns
  KT_UNROLL for (int m = 0; m < M; ++m) {
    part[m][0] = _mm512_dpbf16_ps(part[m][0], lo, (__m512bh)_mm512_loadu_si512(xp + m * K + c));
    part[m][1] = _mm512_dpbf16_ps(part[m][1], hi, (__m512bh)_mm512_loadu_si512(xp + m * K + c + 32));
  }
}

// The scales of a 64-column step's 16 sum lanes: lanes 0-7 hold its first 32 columns, lanes
// 8-15 its last 32, so groups of 32 give two scales, larger groups one.
template <int G>
KT_TARGET_AVX512_BF16 inline __m512 step_scales(const float* s, int64_t c) {
  if constexpr (G == 32) {
    return _mm512_insertf32x8(_mm512_set1_ps(s[c / 32]), _mm256_set1_ps(s[c / 32 + 1]), 1);
  } else {
    return _mm512_set1_ps(s[c / G]);
  }
}

// A group of 128 is two 64-column steps summed before its scale; smaller groups scale every step.
template <int G>
constexpr int64_t kScaleStep = G == 128 ? 128 : 64;

// One scale step (kScaleStep<G> columns from c) of a row into chain i of every x row's total;
// the line of row_ahead (when not null) at the same bytes prefetched.
template <int M, int C, int G>
KT_TARGET_AVX512_BF16 inline void int4_bf16_scale_step(const uint16_t* xp, int64_t K, const uint8_t* row,
                                                       const uint8_t* row_ahead, int64_t c, const float* s,
                                                       __m512i table, int i, __m512 (&total)[M][C]) {
  constexpr int64_t S = kScaleStep<G>;
  if (row_ahead != nullptr) prefetch_lines(row_ahead, c / 2, (c + S) / 2);
  __m512 part[M][2];  // even and odd columns: two independent vdpbf16ps chains
  KT_UNROLL for (int m = 0; m < M; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
  KT_UNROLL for (int64_t t = 0; t < S; t += 64) int4_bf16_step64<M>(xp, K, row, c + t, table, part);
  const __m512 sv = step_scales<G>(s, c);
  KT_UNROLL for (int m = 0; m < M; ++m) {
    total[m][i] = _mm512_fmadd_ps(sv, _mm512_add_ps(part[m][0], part[m][1]), total[m][i]);
  }
}

template <int M, int G, bool Bf16Scales>
KT_TARGET_AVX512_BF16 void gemv_int4_bf16_rows(const uint16_t* x, int64_t ldx, const uint16_t* xp,
                                               const WeightMatrix& w, float* scale_buffer, float* out) {
  constexpr int C = kBf16Chains<M>;
  const int64_t K = w.cols, R = w.rows, ld = w.data.stride(0), groups = K / G, K64 = K / 64 * 64;
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const void* scales = w.scale.const_data_ptr();
  alignas(64) uint16_t words[32];
  for (int i = 0; i < 32; ++i) words[i] = simd::float_to_bf16(float(i % 16 - 8));  // bf16(q - 8), twice
  const __m512i table = _mm512_load_si512(words);
  const int64_t ahead = prefetch_ahead_rows(ld, 1);
  constexpr int64_t S = kScaleStep<G>;
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = base + r * ld;
    const uint8_t* row_ahead = r + ahead < R ? row + ahead * ld : nullptr;
    const float* s = row_scales<Bf16Scales>(scales, r * groups, groups, scale_buffer);
    __m512 total[M][C];
    KT_UNROLL for (int m = 0; m < M; ++m) KT_UNROLL for (int j = 0; j < C; ++j) total[m][j] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + C * S <= K64; c += C * S) {
      KT_UNROLL for (int i = 0; i < C; ++i) {
        int4_bf16_scale_step<M, C, G>(xp, K, row, row_ahead, c + i * S, s, table, i, total);
      }
    }
    for (; c < K64; c += S) int4_bf16_scale_step<M, C, G>(xp, K, row, row_ahead, c, s, table, 0, total);
    for (; c < K; c += 32) {  // K % 64 = 32 (groups of 32 only)
      __m512 part[M];
      KT_UNROLL for (int m = 0; m < M; ++m) part[m] = _mm512_setzero_ps();
      int4_bf16_step32<M>(x, ldx, row, c, table, part);
      const __m512 sv = _mm512_set1_ps(s[c / G]);
      KT_UNROLL for (int m = 0; m < M; ++m) total[m][0] = _mm512_fmadd_ps(sv, part[m], total[m][0]);
    }
    KT_UNROLL for (int m = 0; m < M; ++m) {
      __m512 sum = total[m][0];
      KT_UNROLL for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, total[m][i]);
      out[m * R + r] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <int M>
void gemv_int4_bf16_m(const uint16_t* x, int64_t ldx, const uint16_t* xp, const WeightMatrix& w, float* out) {
  AlignedFloats scale_buffer(w.cols / w.group);
  const bool bf16_scales = w.scale.scalar_type() == at::kBFloat16;
  float* sb = scale_buffer.data();
  switch (w.group) {
    case 32:
      return bf16_scales ? gemv_int4_bf16_rows<M, 32, true>(x, ldx, xp, w, sb, out)
                         : gemv_int4_bf16_rows<M, 32, false>(x, ldx, xp, w, sb, out);
    case 64:
      return bf16_scales ? gemv_int4_bf16_rows<M, 64, true>(x, ldx, xp, w, sb, out)
                         : gemv_int4_bf16_rows<M, 64, false>(x, ldx, xp, w, sb, out);
    default:
      return bf16_scales ? gemv_int4_bf16_rows<M, 128, true>(x, ldx, xp, w, sb, out)
                         : gemv_int4_bf16_rows<M, 128, false>(x, ldx, xp, w, sb, out);
  }
}

}  // namespace

void gemv_int4_bf16(const uint16_t* x, int64_t ldx, int64_t M, const WeightMatrix& w, float* out) {
  TORCH_INTERNAL_ASSERT(w.format == WeightFormat::kInt4);
  const int64_t K = w.cols;
  AlignedFloats xp_buffer((M * K + 1) / 2);
  uint16_t* xp = reinterpret_cast<uint16_t*>(xp_buffer.data());
  bf16_x_evens_odds(x, ldx, M, K, xp);
  for_row_chunks(M, [&](int64_t m0, auto rows) {
    gemv_int4_bf16_m<decltype(rows)::value>(x + m0 * ldx, ldx, xp + m0 * K, w, out + m0 * w.rows);
  });
}

template <int M>
void gemv_avx512(const float* x, const WeightMatrix& w, float* out) {
  gemv_rows<Avx512Kernels, M>(x, w, out);
}

template void gemv_avx512<1>(const float*, const WeightMatrix&, float*);
template void gemv_avx512<2>(const float*, const WeightMatrix&, float*);
template void gemv_avx512<3>(const float*, const WeightMatrix&, float*);
template void gemv_avx512<4>(const float*, const WeightMatrix&, float*);

}  // namespace qgemv
}  // namespace kt
