// Kernels of thin_gemm_nn (see thin_gemm_nn.h): the reference loop, then the AVX2 kernel.
//
// The AVX2 kernel walks w in passes of a few rows (4 for one row of d, 2 for two to four: the
// coefficients, decoded weights and two accumulators must fit in the 16 ymm registers) and,
// per pass, 16 columns at a time: each of the pass's rows decoded once into two vectors of 8
// floats, then, per row m of d, two accumulator vectors loaded, one FMA per weight row and
// vector, and stored back (the accumulator rows, K floats each, stay in L1). Per format:
//   bf16: the 16 values widened to float32 (shift into the high half);
//   int8: vpmovsxbd + vcvtdq2ps, the row's scale in the coefficient;
//   int4: 8 bytes zero-extended to 32 bits, low nibbles (even columns) and high nibbles (odd
//         columns) minus 8, converted: q exactly. The accumulator holds each 16 columns as
//         evens then odds and is put back in column order at the end; the group's scale is in
//         the coefficient (groups of 32, 64 or 128 columns: whole steps);
//   fp8:  fp16 bit patterns of the bytes (value / 2^8, subnormals included, vcvtph2ps), the
//         block's scale times 2^8 in the coefficient; the bytes' largest magnitude kept to spot
//         NaN codes (0x7f, 0xff), after which the call is redone by the reference loop.
// Columns after the last whole 16-column step (bf16, int8 and fp8 rows of any length) are
// added one by one.
#include "kernels/thin_gemm_nn.h"

#include <algorithm>
#include <vector>

#include "kernels/dequantize.h"
#include "kernels/quant_gemv_internal.h"
#include "platform/simd.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace {

// acc [M, K] += d [M, N] · w [N, K], w's rows dequantized (or widened from bf16) into float32
// one at a time. The portable path, and the AVX2 kernel's fallback for fp8 NaN codes.
void nn_reference(const float* d, int64_t M, const WeightMatrix& w, float* acc) {
  const int64_t N = w.rows, K = w.cols;
  std::vector<float> row(K);
  for (int64_t i = 0; i < N; ++i) {
    if (w.quantized()) {
      dequantize_rows(w, i, 1, row.data(), K, CpuIsa::kPortable);
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(w.data.const_data_ptr()) + i * w.data.stride(0);
      for (int64_t k = 0; k < K; ++k) row[k] = simd::bf16_to_float(src[k]);
    }
    for (int64_t m = 0; m < M; ++m) {
      const float c = d[m * N + i];
      float* a = acc + m * K;
      for (int64_t k = 0; k < K; ++k) a[k] += c * row[k];
    }
  }
}

// ---- per format: row bytes, the coefficient's scale, 16 columns decoded, one value -----------

struct Bf16Rows {
  const uint8_t* base;
  int64_t ld;  // bytes between rows
  int64_t segment;
  const uint8_t* row(int64_t i) const { return base + i * ld; }
  static constexpr int64_t kBytesPer16 = 32;
  float scale(int64_t, int64_t) const { return 1.f; }
  KT_TARGET_AVX2 void decode16(const uint8_t* row, int64_t k, __m256& lo, __m256& hi, __m128i&) const {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + k;
    lo = simd::load8_bf16(p);
    hi = simd::load8_bf16(p + 8);
  }
  float value(int64_t i, int64_t k) const {
    return simd::bf16_to_float(reinterpret_cast<const uint16_t*>(row(i))[k]);
  }
};

template <bool Bf16Scales>
struct Int8Rows {
  const uint8_t* base;
  int64_t ld;
  int64_t segment;
  const void* scales;  // [rows]
  const uint8_t* row(int64_t i) const { return base + i * ld; }
  static constexpr int64_t kBytesPer16 = 16;
  float scale(int64_t i, int64_t) const { return qgemv::load_scale<Bf16Scales>(scales, i); }
  KT_TARGET_AVX2 void decode16(const uint8_t* row, int64_t k, __m256& lo, __m256& hi, __m128i&) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
  }
  float value(int64_t i, int64_t k) const { return float(static_cast<int8_t>(row(i)[k])) * scale(i, 0); }
};

template <bool Bf16Scales>
struct Int4Rows {
  const uint8_t* base;
  int64_t ld;
  int64_t segment;  // the group size
  const void* scales;  // [rows, cols / g]
  int64_t groups;
  const uint8_t* row(int64_t i) const { return base + i * ld; }
  static constexpr int64_t kBytesPer16 = 8;
  float scale(int64_t i, int64_t group) const { return qgemv::load_scale<Bf16Scales>(scales, i * groups + group); }
  KT_TARGET_AVX2 void decode16(const uint8_t* row, int64_t k, __m256& lo, __m256& hi, __m128i&) const {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2)));
    const __m256i eight = _mm256_set1_epi32(8);
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0x0f)), eight));
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight));
  }
  float value(int64_t, int64_t) const { return 0.f; }  // no column tail: K is a multiple of g
};

// mxfp4 / nvfp4: each nibble's value (2 · e2m1) by a byte shuffle, in column order; the
// scale_table's half scale goes into the coefficient (their product is the weight exactly).
struct Fp4Rows {
  const uint8_t* base;
  int64_t ld;
  int64_t segment;        // the group size: 32 or 16
  const uint8_t* scales;  // [rows, cols / g] scale bytes
  int64_t groups;
  const float* table;     // WeightMatrix::scale_table
  const int8_t* values;   // nibble_values
  const uint8_t* row(int64_t i) const { return base + i * ld; }
  static constexpr int64_t kBytesPer16 = 8;
  float scale(int64_t i, int64_t group) const { return table[scales[i * groups + group]]; }
  KT_TARGET_AVX2 void decode16(const uint8_t* row, int64_t k, __m256& lo, __m256& hi, __m128i&) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)), codes);
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  }
  float value(int64_t, int64_t) const { return 0.f; }  // no column tail: K is a multiple of 32
};

template <bool Bf16Scales>
struct Fp8Rows {
  const uint8_t* base;
  int64_t ld;
  int64_t segment;  // 128
  const void* scales;  // [ceil(rows / 128), ceil(cols / 128)]
  int64_t blocks;
  const uint8_t* row(int64_t i) const { return base + i * ld; }
  // The bit patterns decode to value / 2^8: 2^8 goes into the coefficient.
  static constexpr int64_t kBytesPer16 = 16;
  float scale(int64_t i, int64_t block) const {
    return qgemv::load_scale<Bf16Scales>(scales, (i / kFp8Block) * blocks + block) * 256.f;
  }
  KT_TARGET_AVX2 void decode16(const uint8_t* row, int64_t k, __m256& lo, __m256& hi, __m128i& seen) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    seen = _mm_max_epu8(seen, _mm_and_si128(b, _mm_set1_epi8(0x7f)));
    // Sign-extended to 16 bits and shifted left by 7: the sign at bit 15, a copy of it at bit
    // 14 (cleared by the mask), exponent and mantissa where an fp16's are.
    const __m256i words =
        _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(int16_t(0xbf80)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(words));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(words, 1));
  }
  float value(int64_t i, int64_t k) const {
    return fp8_e4m3_to_float(row(i)[k]) * (scale(i, k / kFp8Block) / 256.f);
  }
};

// Rows of w per pass: the pass's coefficients (M x R), decoded weights (2R) and two
// accumulators stay in registers.
template <int M>
constexpr int kPassRows = M == 1 ? 4 : 2;

// acc [M, K] += d[:, i0:i0+R] · w[i0:i0+R, :k_main], R rows of w in one pass, prefetching the
// same columns of the next pass's rows (the last row at the end) as it goes: R streams side by side,
// which Zen 3's hardware prefetcher alone left at 5 G weights/s from memory (int8, one row).
template <int M, int R, class Rows>
KT_TARGET_AVX2 void nn_pass(const float* d, int64_t N, int64_t K, int64_t k_main, const Rows& rows, int64_t i0,
                            float* acc, __m128i& seen, float* coef) {
  const uint8_t* row[R];
  const uint8_t* next[R];
  KT_UNROLL for (int r = 0; r < R; ++r) {
    row[r] = rows.row(i0 + r);
    next[r] = rows.row(std::min(i0 + R + r, N - 1));
  }
  // The coefficients d[m, i] · scale of every segment (scale block or group) of the pass's rows,
  // up front: computed per segment inside the loop they cost int4 (groups of 32: a segment
  // every two steps) half its speed (5.8 against 8.5-12.5 G weights/s with groups of 128).
  const int64_t segments = (k_main + rows.segment - 1) / rows.segment;
  KT_UNROLL for (int r = 0; r < R; ++r) {
    for (int64_t seg = 0; seg < segments; ++seg) {
      const float s = rows.scale(i0 + r, seg);
      KT_UNROLL for (int m = 0; m < M; ++m) coef[(m * R + r) * segments + seg] = d[m * N + i0 + r] * s;
    }
  }
  int64_t segment = 0;  // which scale block / group the columns k0.. are in
  for (int64_t k0 = 0; k0 < k_main; k0 += rows.segment, ++segment) {
    const int64_t k1 = std::min(k0 + rows.segment, k_main);
    __m256 c[M][R];
    KT_UNROLL for (int m = 0; m < M; ++m) {
      KT_UNROLL for (int r = 0; r < R; ++r) c[m][r] = _mm256_broadcast_ss(coef + (m * R + r) * segments + segment);
    }
    for (int64_t k = k0; k < k1; k += 16) {
      __m256 lo[R], hi[R];
      const int64_t byte = k / 16 * Rows::kBytesPer16;
      if (byte % 64 == 0) {
        KT_UNROLL for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next[r] + byte), _MM_HINT_T0);
      }
      KT_UNROLL for (int r = 0; r < R; ++r) rows.decode16(row[r], k, lo[r], hi[r], seen);
      KT_UNROLL for (int m = 0; m < M; ++m) {
        float* a = acc + m * K + k;
        __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8);
        KT_UNROLL for (int r = 0; r < R; ++r) {
          a0 = _mm256_fmadd_ps(c[m][r], lo[r], a0);
          a1 = _mm256_fmadd_ps(c[m][r], hi[r], a1);
        }
        _mm256_storeu_ps(a, a0);
        _mm256_storeu_ps(a + 8, a1);
      }
    }
  }
}

// Every row of w: passes of kPassRows<M> rows, the rest one by one; then the column tail.
// Returns whether the bytes held an fp8 NaN code.
template <int M, class Rows>
KT_TARGET_AVX2 bool nn_avx2(const float* d, int64_t N, int64_t K, const Rows& rows, float* acc) {
  constexpr int R = kPassRows<M>;
  const int64_t k_main = K / 16 * 16;
  __m128i seen = _mm_setzero_si128();
  std::vector<float> coef(M * R * std::max<int64_t>((k_main + rows.segment - 1) / rows.segment, 1));
  int64_t i = 0;
  for (; i + R <= N; i += R) nn_pass<M, R>(d, N, K, k_main, rows, i, acc, seen, coef.data());
  for (; i < N; ++i) nn_pass<M, 1>(d, N, K, k_main, rows, i, acc, seen, coef.data());
  for (int64_t k = k_main; k < K; ++k) {
    for (int64_t r = 0; r < N; ++r) {
      const float v = rows.value(r, k);
      for (int m = 0; m < M; ++m) acc[m * K + k] += d[m * N + r] * v;
    }
  }
  return _mm_movemask_epi8(_mm_cmpeq_epi8(seen, _mm_set1_epi8(0x7f))) != 0;
}

template <class Rows>
KT_TARGET_AVX2 bool nn_avx2_rows(const float* d, int64_t M, int64_t N, int64_t K, const Rows& rows, float* acc) {
  switch (M) {
    case 1: return nn_avx2<1>(d, N, K, rows, acc);
    case 2: return nn_avx2<2>(d, N, K, rows, acc);
    case 3: return nn_avx2<3>(d, N, K, rows, acc);
    default: return nn_avx2<4>(d, N, K, rows, acc);
  }
}

// Each 16 columns of the M x K rows: column order <-> evens then odds (int4's accumulator).
void permute16(float* rows, int64_t M, int64_t K, bool to_permuted) {
  float tmp[16];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 16) {
      float* p = rows + m * K + k;
      for (int j = 0; j < 8; ++j) {
        if (to_permuted) {
          tmp[j] = p[2 * j];
          tmp[8 + j] = p[2 * j + 1];
        } else {
          tmp[2 * j] = p[j];
          tmp[2 * j + 1] = p[8 + j];
        }
      }
      std::copy(tmp, tmp + 16, p);
    }
  }
}

template <bool Bf16Scales>
bool nn_avx2_quantized(const float* d, int64_t M, const WeightMatrix& w, float* acc) {
  const uint8_t* base = static_cast<const uint8_t*>(w.data.const_data_ptr());
  const int64_t ld = w.data.stride(0), N = w.rows, K = w.cols;
  const void* scales = w.scale.const_data_ptr();
  switch (w.format) {
    case WeightFormat::kInt8:
      return nn_avx2_rows(d, M, N, K, Int8Rows<Bf16Scales>{base, ld, std::max<int64_t>(K, 1), scales}, acc);
    case WeightFormat::kMxfp4:
    case WeightFormat::kNvfp4:
      return nn_avx2_rows(d, M, N, K,
                          Fp4Rows{base, ld, w.group, static_cast<const uint8_t*>(scales), w.scale.size(1),
                                  w.scale_table, nibble_values(w.format)},
                          acc);
    case WeightFormat::kInt4: {
      permute16(acc, M, K, /*to_permuted=*/true);
      nn_avx2_rows(d, M, N, K, Int4Rows<Bf16Scales>{base, ld, w.group, scales, w.scale.size(1)}, acc);
      permute16(acc, M, K, /*to_permuted=*/false);
      return false;
    }
    default:
      return nn_avx2_rows(d, M, N, K, Fp8Rows<Bf16Scales>{base, ld, kFp8Block, scales, w.scale.size(1)}, acc);
  }
}

}  // namespace

at::Tensor thin_gemm_nn(const at::Tensor& d, const WeightMatrix& w, const std::optional<at::Tensor>& addend,
                        CpuIsa isa) {
  TORCH_CHECK(d.dim() == 2 && d.size(1) == w.rows, "thin_gemm_nn: expected d [M, ", w.rows, "], got ", d.sizes());
  TORCH_CHECK(d.scalar_type() == at::kFloat || d.scalar_type() == at::kBFloat16,
              "thin_gemm_nn: d must be float32 or bfloat16, got ", d.scalar_type());
  TORCH_CHECK(w.quantized() || w.data.scalar_type() == at::kBFloat16,
              "thin_gemm_nn: w must be bfloat16 or quantized, got ", w.data.scalar_type());
  TORCH_CHECK(w.quantized() || w.data.stride(1) == 1, "thin_gemm_nn: w's rows must be contiguous");
  const int64_t M = d.size(0), K = w.cols;
  TORCH_CHECK(M <= kThinNnMaxRows, "thin_gemm_nn: at most ", kThinNnMaxRows, " rows of d, got ", M);
  const at::Tensor d32 = d.to(at::kFloat).contiguous();
  at::Tensor acc = addend.has_value() ? addend->to(at::kFloat).contiguous().clone()
                                      : at::zeros({M, K}, d.options().dtype(at::kFloat));
  TORCH_CHECK(acc.sizes() == at::IntArrayRef({M, K}), "thin_gemm_nn: addend must be [", M, ", ", K, "]");
  if (M == 0 || K == 0 || w.rows == 0) return acc.to(d.scalar_type());
  const float* dp = d32.const_data_ptr<float>();
  float* ap = acc.mutable_data_ptr<float>();

  bool redo = isa == CpuIsa::kPortable;
  if (!redo) {
    const at::Tensor start = w.format == WeightFormat::kFp8 ? acc.clone() : at::Tensor();
    if (!w.quantized()) {
      nn_avx2_rows(dp, M, w.rows, K,
                   Bf16Rows{static_cast<const uint8_t*>(w.data.const_data_ptr()), w.data.stride(0) * 2,
                            std::max<int64_t>(K, 1)},
                   ap);
    } else if (w.scale.scalar_type() == at::kBFloat16) {
      redo = nn_avx2_quantized<true>(dp, M, w, ap);
    } else {
      redo = nn_avx2_quantized<false>(dp, M, w, ap);
    }
    if (redo) acc.copy_(start);  // an fp8 NaN code: the reference loop propagates it exactly
  }
  if (redo) nn_reference(dp, M, w, ap);
  return d.scalar_type() == at::kFloat ? acc : acc.to(d.scalar_type());
}

}  // namespace kt
