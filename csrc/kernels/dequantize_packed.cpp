#include "kernels/dequantize_packed.h"

#include <vector>

#include "kernels/dequantize.h"
#include "kernels/dequantize_internal.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace {

using dequant::decode32_bf16;
using dequant::QuantView;

// ---- reference: dequantize_block's reference loop, one row at a time, scattered -------------

void rows_reference(const WeightMatrix& w, int64_t n0, const PackedBf16Layout& l, uint16_t* dst) {
  std::vector<uint16_t> row(l.in);
  for (int64_t o = 0; o < l.out; ++o) {
    dequantize_block(w, n0 + o, 1, 0, l.in, row.data(), l.in, CpuIsa::kPortable);
    for (int64_t i = 0; i < l.in; ++i) dst[l.offset(o, i)] = row[i];
  }
}

void cols_reference(const WeightMatrix& w, int64_t k0, const PackedBf16Layout& l, int64_t in0, uint16_t* dst) {
  std::vector<uint16_t> row(l.out);
  for (int64_t n = 0; n < w.rows; ++n) {
    dequantize_block(w, n, 1, k0, l.out, row.data(), l.out, CpuIsa::kPortable);
    for (int64_t o = 0; o < l.out; ++o) dst[l.offset(o, in0 + n)] = row[o];
  }
}

// ---- AVX512-BF16 ------------------------------------------------------------------------------

// Prefetch distances: columns ahead in a row (rows kernel), rows ahead (cols kernel). 16 rows
// ahead read the weights from memory at 11-15 G weights/s where 4 had read them at 7-9 (one
// thread, 256-column panels of [1536, 2048], AMD Zen 5); 8 and 32 gave less, and the rows
// kernel's distance and T1 hints made no difference there. The cols kernel prefetches into L2
// (T1): on Zen 4 (512-column panels) fp8 from memory went from 4.4-5.3 to 7.7-7.8 G weights/s,
// int8 from 4.9-5.4 to 7.0-7.4, int4 from 4.5-8.2 to 8.1-9.1.
constexpr int64_t kPrefetchColumns = 256;
constexpr int64_t kPrefetchRows = 16;

// Bytes of c columns of a row.
template <WeightFormat F>
constexpr int64_t column_bytes(int64_t c) {
  return is_nibble_format(F) ? c / 2 : c;
}

// offset(o, i) of a layout as the sum of a part of o and a part of i, without the divisions in
// the kernels' inner loops: out_block is a power of two (kOutBlocks of packed_layout.cpp).
// Computing offset() for every store had made the d·w kernel division-bound: 3.7-3.9 G
// weights/s, now 5.2-6.2 (one thread, panels of 256 columns of a [1536, 2048] weight, Intel
// Xeon with AMX).
struct OutPart {
  int shift;
  int64_t mask, block_stride;
  explicit OutPart(const PackedBf16Layout& l)
      : shift(__builtin_ctzll(l.out_block)), mask(l.out_block - 1), block_stride(l.in * l.out_block) {}
  int64_t operator()(int64_t o) const { return (o >> shift) * block_stride + (o & mask) * 2; }
};

// The part of an even i: in_block is the whole row or a power of two (kInBlocks).
struct InPart {
  bool whole_row;
  int shift;
  int64_t mask, out_block;
  explicit InPart(const PackedBf16Layout& l)
      : whole_row(l.in_block == l.in), shift(__builtin_ctzll(l.in_block)), mask(l.in_block - 1),
        out_block(l.out_block) {}
  int64_t operator()(int64_t i) const {
    return whole_row ? i * out_block : (i >> shift) * ((mask + 1) * out_block) + (i & mask) * out_block;
  }
};

// Before the x·wᵀ tile of 16 rows from r0 at columns i0 .. i0+31 of rows `in` columns long:
// each of the 16 rows' line kPrefetchColumns ahead (the next 16 rows' first columns near the
// end of these), once per cache line. The weights mostly come from memory, and the hardware's
// prefetchers do not follow 16 interleaved streams.
template <WeightFormat F>
KT_TARGET_AVX512 inline void prefetch_tile_ahead(const QuantView& q, int64_t rows, int64_t r0, int64_t i0,
                                                 int64_t in) {
  if (column_bytes<F>(i0) % 64 != 0) return;
  const int64_t ahead = i0 + kPrefetchColumns;
  const int64_t ahead_row = ahead < in ? r0 : r0 + 16;
  const int64_t ahead_bytes = column_bytes<F>(ahead < in ? ahead : ahead - in);
  for (int r = 0; r < 16 && ahead_row + r < rows; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(q.row(ahead_row + r) + ahead_bytes), _MM_HINT_T0);
  }
}

// One byte of each cache line of rows [r0, r1), `bytes` long, read in order: one sequential
// stream, which the hardware prefetcher follows at the memory's speed, where the x·wᵀ tiles
// read 16 rows side by side. Read so before its tiles are decoded, a 16-row band is then in
// L1 and L2. fp8 x·wᵀ from memory went from 4.0-5.0 to 4.9-6.9 G weights/s (one thread,
// [512, 2048] panels of 16 [1536, 2048] experts in turn, AMD Zen 4), kt.moe's fp8 LoRA step at
// T=1024 from 0.79-0.82x to 0.82-0.84x bf16's speed (two runs switching it on and off in one
// process); the prefetches alone had not moved it at 256-2048 columns ahead with any hint.
inline void read_rows_in_order(const QuantView& q, int64_t r0, int64_t r1, int64_t bytes) {
  uint32_t sum = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = q.row(r);
    for (int64_t o = 0; o < bytes; o += 64) sum += row[o];
  }
  __asm__ volatile("" : : "r"(sum));  // the loads are the point: keep them
}

// r[i] element j -> r[j] element i, for 16 vectors of 16 dwords.
KT_TARGET_AVX512 inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // s[4q + m], 128-bit lane l: element 4l + m of rows 4q .. 4q+3
  __m512i s[16];
  for (int q = 0; q < 16; q += 4) {
    s[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
    s[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
    s[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
    s[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  // element 4l + m of all rows: lane l of s[m], s[4 + m], s[8 + m], s[12 + m]
  for (int m = 0; m < 4; ++m) {
    const __m512i v0 = _mm512_shuffle_i32x4(s[m], s[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(s[m], s[4 + m], 0xee);
    const __m512i v2 = _mm512_shuffle_i32x4(s[8 + m], s[12 + m], 0x44),
                  v3 = _mm512_shuffle_i32x4(s[8 + m], s[12 + m], 0xee);
    r[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// 32 columns of a row of a nibble format, c a multiple of 32: int4 by one scale (its groups
// are 32 or more), fp4 by the scales of its two halves (nvfp4's groups are 16).
template <WeightFormat F>
KT_TARGET_AVX512_BF16 inline __m512i decode32_nibble_row(const QuantView& q, int64_t row, int64_t c) {
  if constexpr (F != WeightFormat::kNvfp4) {
    return decode32_bf16<F>(q.row(row), c, q.scale<F>(row, c));
  } else {
    return dequant::decode32_nibbles_bf16<F>(q.row(row), c, q.scale<F>(row, c), q.scale<F>(row, c + 16));
  }
}

// int4 / fp4 tiles of 16 rows by 32 columns (one group, or two of nvfp4's), decoded a row at a
// time (the lookup table is the row's: decode32_bf16): each row's 32 columns are 16 column
// pairs (dwords); the transpose puts pair j of the 16 rows side by side, 64 contiguous bytes
// of the layout.
template <WeightFormat F>
KT_TARGET_AVX512_BF16 void rows_values_first_avx512_bf16(const WeightMatrix& w, int64_t n0,
                                                         const PackedBf16Layout& l, uint16_t* dst) {
  static_assert(is_nibble_format(F), "fp8 and int8 take rows_bytes_first_avx512_bf16");
  const QuantView q(w);
  const OutPart out_part(l);
  const InPart in_part(l);
  __m512i t[16];
  for (int64_t o0 = 0; o0 < l.out; o0 += 16) {
    for (int64_t i0 = 0; i0 < l.in; i0 += 32) {
      prefetch_tile_ahead<F>(q, w.rows, n0 + o0, i0, l.in);
      for (int r = 0; r < 16; ++r) {
        const int64_t row = n0 + o0 + r;
        t[r] = decode32_nibble_row<F>(q, row, i0);
      }
      transpose16x16_epi32(t);
      uint16_t* tile = dst + out_part(o0) + in_part(i0);  // pair j of the tile: out_block pairs further on
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + j * l.out_block * 2, t[j]);
    }
  }
}

// An 8 x 8 transpose of 16-bit units inside every 128-bit lane of 8 registers: unit k of lane L
// of r[j] -> unit j of lane L of r[k].
KT_TARGET_AVX512 inline void transpose8x8_epi16_in_lanes(__m512i r[8]) {
  __m512i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi16(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi16(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm512_unpacklo_epi32(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi32(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi32(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi32(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    r[2 * k] = _mm512_unpacklo_epi64(u[k], u[k + 4]);
    r[2 * k + 1] = _mm512_unpackhi_epi64(u[k], u[k + 4]);
  }
}

// The 16 scales of rows r .. r+15 as the lanes of decode32_bytes_bf16's two halves: lanes 2j
// and 2j + 1 of lo hold row j's, of hi row 8 + j's (int8: one scale per row).
KT_TARGET_AVX512 inline void pair_lane_scales(const QuantView& q, int64_t r, __m512& lo, __m512& hi) {
  const __m512 s = q.scale_f32 != nullptr ? _mm512_loadu_ps(q.scale_f32 + r) : simd::load16_bf16(q.scale_bf16 + r);
  alignas(64) static constexpr int32_t kLo[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
  const __m512i idx = _mm512_load_si512(kLo);
  lo = _mm512_permutexvar_ps(idx, s);
  hi = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(8)), s);
}

// fp8: the value tables (dequant::fill_fp8_table) of one band of 128 rows, one per block of the
// columns [begin, end) a kernel decodes, made again when a row of another band comes.
class Fp8BandTables {
 public:
  Fp8BandTables(int64_t begin, int64_t end)
      : begin_(begin), values_((end - begin + kFp8Block - 1) / kFp8Block * dequant::kFp8TableEntries) {}

  // Makes the tables of `row`'s band unless they are the current ones.
  KT_TARGET_AVX512_BF16 void for_row(const QuantView& q, int64_t row) {
    if (row / kFp8Block == band_) return;
    band_ = row / kFp8Block;
    for (size_t t = 0; t < values_.size(); t += dequant::kFp8TableEntries) {
      const int64_t c = begin_ + int64_t(t / dequant::kFp8TableEntries) * kFp8Block;
      dequant::fill_fp8_table(q.scale<WeightFormat::kFp8>(row, c), values_.data() + t);
    }
  }

  // The table of column c's block.
  KT_TARGET_AVX512 dequant::Fp8Table at(int64_t c) const {
    return dequant::load_fp8_table(values_.data() + (c - begin_) / kFp8Block * dequant::kFp8TableEntries);
  }

 private:
  int64_t begin_;
  int64_t band_ = -1;
  std::vector<uint16_t> values_;
};

// 32 bytes already in a register: fp8 through its scale's table, int8 by its lane scales.
template <WeightFormat F>
KT_TARGET_AVX512_BF16 inline __m512i decode32_bytes(__m256i bytes, const dequant::Fp8Table& table, __m512 s_lo,
                                                    __m512 s_hi) {
  if constexpr (F == WeightFormat::kFp8) return dequant::decode32_fp8_table(bytes, table);
  return dequant::decode32_bytes_bf16<F>(bytes, s_lo, s_hi);
}

// Columns c .. c+31 of a row: fp8 through its scale's table, int8 and int4 by `scale`.
template <WeightFormat F>
KT_TARGET_AVX512_BF16 inline __m512i decode32(const uint8_t* row, int64_t c, float scale,
                                              const dequant::Fp8Table& table) {
  if constexpr (F == WeightFormat::kFp8) {
    return dequant::decode32_fp8_table(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)), table);
  }
  return decode32_bf16<F>(row, c, scale);
}

// fp8 / int8 tiles of 16 rows by 32 columns, rearranged as bytes before they are decoded: the
// 32 bytes of rows j and j + 8 in one register (j < 8), an 8 x 8 transpose of column pairs in
// every lane, a lane shuffle, and each half of a register is then column pair p of the 16 rows,
// which decodes straight into the 64 bytes of the layout. Transposing the decoded bf16 values
// instead (rows_values_first_avx512_bf16, which int4 keeps: its lookup table is one row's) shuffled twice
// the bytes: one thread, 256-row panels of a [1536, 2048] weight, Intel Xeon with AMX, best of
// four alternating runs, fp8 108 -> 89 us, int8 79 -> 62 us. The tile's 16 rows share one fp8
// block scale; int8's row scales are two vectors per 16 rows.
template <WeightFormat F>
KT_TARGET_AVX512_BF16 void rows_bytes_first_avx512_bf16(const WeightMatrix& w, int64_t n0, const PackedBf16Layout& l,
                                                        uint16_t* dst) {
  static_assert(F == WeightFormat::kFp8 || F == WeightFormat::kInt8, "fp8 or int8");
  const QuantView q(w);
  const OutPart out_part(l);
  const InPart in_part(l);
  Fp8BandTables tables(0, F == WeightFormat::kFp8 ? l.in : 0);
  for (int64_t o0 = 0; o0 < l.out; o0 += 16) {
    const int64_t r0 = n0 + o0;
    read_rows_in_order(q, r0, r0 + 16, column_bytes<F>(l.in));  // the 16 rows the tiles below read
    __m512 s_lo, s_hi;
    if constexpr (F == WeightFormat::kInt8) pair_lane_scales(q, r0, s_lo, s_hi);
    if constexpr (F == WeightFormat::kFp8) tables.for_row(q, r0);
    for (int64_t i0 = 0; i0 < l.in; i0 += 32) {
      dequant::Fp8Table table{};
      if constexpr (F == WeightFormat::kFp8) table = tables.at(i0);
      prefetch_tile_ahead<F>(q, w.rows, r0, i0, l.in);
      __m512i v[8];
      for (int j = 0; j < 8; ++j) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.row(r0 + j) + i0));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.row(r0 + j + 8) + i0));
        v[j] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      }
      // lane L of v[k]: pair k (L = 0) / 8 + k (L = 1) of rows 0-7, the same of rows 8-15 (L = 2, 3)
      transpose8x8_epi16_in_lanes(v);
      uint16_t* tile = dst + out_part(o0) + in_part(i0);  // pair p of the tile: out_block pairs further on
      for (int k = 0; k < 8; ++k) {
        const __m512i z = _mm512_shuffle_i64x2(v[k], v[k], 0xd8);  // lanes 0, 2, 1, 3
        _mm512_storeu_si512(tile + k * l.out_block * 2,
                            decode32_bytes<F>(_mm512_castsi512_si256(z), table, s_lo, s_hi));
        _mm512_storeu_si512(tile + (8 + k) * l.out_block * 2,
                            decode32_bytes<F>(_mm512_extracti64x4_epi64(z, 1), table, s_lo, s_hi));
      }
    }
  }
}

// Rows n and n + 1, 32 columns at a time: interleaved, the pairs (n, n + 1) of 2 x 16 output
// rows.
template <WeightFormat F>
KT_TARGET_AVX512_BF16 void cols_avx512_bf16(const WeightMatrix& w, int64_t k0, const PackedBf16Layout& l,
                                            int64_t in0, uint16_t* dst) {
  alignas(64) static constexpr uint16_t kFirst[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                      37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                      11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i first = _mm512_load_si512(kFirst);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  const QuantView q(w);
  const int64_t k1 = k0 + l.out;
  // Columns per scale: an fp8 block, an int4 / mxfp4 group (at least 32), int8's whole row;
  // nvfp4's groups of 16 are read two at a time (decode32_nibble_row).
  const int64_t run = F == WeightFormat::kFp8    ? kFp8Block
                      : F == WeightFormat::kInt8  ? l.out
                      : F == WeightFormat::kNvfp4 ? 32
                                                  : w.group;
  const int64_t segment_bytes = column_bytes<F>(l.out);
  const OutPart out_part(l);
  Fp8BandTables tables(k0, F == WeightFormat::kFp8 ? k1 : k0);  // rows n and n + 1 share their band
  for (int64_t n = 0; n < w.rows; n += 2) {
    uint16_t* pair_dst = dst + l.offset(0, in0 + n);  // + out_part(o): pair (n, n + 1) of output o
    const uint8_t* a = q.row(n);
    const uint8_t* b = q.row(n + 1);
    if (n + kPrefetchRows + 1 < w.rows) {  // the segments of the rows a few pairs on (see prefetch_tile_ahead)
      const uint8_t* next = q.row(n + kPrefetchRows) + column_bytes<F>(k0);
      for (int64_t off = 0; off < segment_bytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + q.row_stride + off), _MM_HINT_T1);
      }
      if constexpr (is_nibble_format(F)) {  // a row's scales of the segment: one line at most, mostly
        _mm_prefetch(q.scale_address<F>(n + kPrefetchRows, k0), _MM_HINT_T0);
        _mm_prefetch(q.scale_address<F>(n + kPrefetchRows + 1, k0), _MM_HINT_T0);
      }
    }
    if constexpr (F == WeightFormat::kFp8) tables.for_row(q, n);
    for (int64_t c0 = k0; c0 < k1; c0 += run) {
      float sa = 0.f, sb = 0.f;  // the fp4 formats look their scales up per 32 columns
      if constexpr (!is_fp4(F)) {
        sa = q.scale<F>(n, c0);
        sb = q.scale<F>(n + 1, c0);
      }
      dequant::Fp8Table table{};
      if constexpr (F == WeightFormat::kFp8) table = tables.at(c0);
      for (int64_t c = c0; c < std::min(c0 + run, k1); c += 32) {
        __m512i va, vb;
        if constexpr (is_fp4(F)) {
          va = decode32_nibble_row<F>(q, n, c);
          vb = decode32_nibble_row<F>(q, n + 1, c);
        } else {
          va = decode32<F>(a, c, sa, table);
          vb = decode32<F>(b, c, sb, table);
        }
        _mm512_storeu_si512(pair_dst + out_part(c - k0), _mm512_permutex2var_epi16(va, first, vb));
        _mm512_storeu_si512(pair_dst + out_part(c - k0 + 16), _mm512_permutex2var_epi16(va, second, vb));
      }
    }
  }
}

template <template <WeightFormat> class Kernel, typename... Args>
void on_format(WeightFormat f, Args&&... args) {
  switch (f) {
    case WeightFormat::kFp8: return Kernel<WeightFormat::kFp8>::run(args...);
    case WeightFormat::kInt8: return Kernel<WeightFormat::kInt8>::run(args...);
    case WeightFormat::kInt4: return Kernel<WeightFormat::kInt4>::run(args...);
    case WeightFormat::kMxfp4: return Kernel<WeightFormat::kMxfp4>::run(args...);
    case WeightFormat::kNvfp4: return Kernel<WeightFormat::kNvfp4>::run(args...);
    default: TORCH_INTERNAL_ASSERT(false, "no packed kernel for ", weight_format_name(f));
  }
}

template <WeightFormat F>
struct Rows {
  static void run(const WeightMatrix& w, int64_t n0, const PackedBf16Layout& l, uint16_t* dst) {
    if constexpr (is_nibble_format(F)) {
      rows_values_first_avx512_bf16<F>(w, n0, l, dst);
    } else {
      rows_bytes_first_avx512_bf16<F>(w, n0, l, dst);
    }
  }
};

template <WeightFormat F>
struct Cols {
  static void run(const WeightMatrix& w, int64_t k0, const PackedBf16Layout& l, int64_t in0, uint16_t* dst) {
    cols_avx512_bf16<F>(w, k0, l, in0, dst);
  }
};

}  // namespace

void dequantize_packed_rows(const WeightMatrix& w, int64_t n0, const PackedBf16Layout& layout, uint16_t* dst,
                            CpuIsa isa) {
  TORCH_INTERNAL_ASSERT(w.quantized() && layout.in == w.cols && n0 >= 0 && n0 + layout.out <= w.rows &&
                        n0 % 16 == 0 && layout.out_block % 16 == 0 && layout.in_block % 32 == 0);
  if (isa != CpuIsa::kAvx512Bf16) return rows_reference(w, n0, layout, dst);
  on_format<Rows>(w.format, w, n0, layout, dst);
}

void dequantize_packed_cols(const WeightMatrix& w, int64_t k0, const PackedBf16Layout& layout, uint16_t* dst,
                            CpuIsa isa, int64_t in0) {
  TORCH_INTERNAL_ASSERT(w.quantized() && in0 >= 0 && in0 % 2 == 0 && w.rows % 2 == 0 && in0 + w.rows <= layout.in &&
                        k0 >= 0 && k0 + layout.out <= w.cols && k0 % 32 == 0 && (k0 % kFp8Block == 0 || layout.out == 32) &&
                        layout.out % 32 == 0 &&
                        layout.out_block % 16 == 0 && layout.in_block % 2 == 0);
  if (isa != CpuIsa::kAvx512Bf16) return cols_reference(w, k0, layout, in0, dst);
  on_format<Cols>(w.format, w, k0, layout, in0, dst);
}

}  // namespace kt
