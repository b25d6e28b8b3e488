#include "gemm/amx_gemm.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "platform/cpu_isa.h"
#include "kernels/dequantize_packed.h"
#include "gemm/packed_layout.h"
#include "platform/simd.h"
#include "platform/x86_intrinsics.h"

namespace kt {
namespace {

#ifndef KT_OPS_EMULATE_AVX512
#define KT_TARGET_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))
#else
#define KT_TARGET_AMX KT_TARGET_AVX2  // the emulated test build's tiles are memory (x86_intrinsics.h)
#endif

// The tiles: C (float32 sums of 16 x rows by 16 outputs) in 0-3, x in 4-5, weights in 6-7.
// Each output strip is 32 weight columns (two 16-column blocks), so one step of 32 input
// columns is 2 x tiles, 2 weight tiles and 4 TDPBF16PS on 32 x rows.
constexpr int64_t kStrip = 32;  // outputs per strip
constexpr int64_t kTileRows = 16;
constexpr int64_t kStepCols = 32;  // input columns per tile step (16 pairs)
constexpr int64_t kTileValues = kTileRows * kStepCols;  // bf16 values of one 1 KiB tile

bool probe_amx_bf16() {
#ifdef KT_OPS_EMULATE_AVX512
  return true;  // the emulated test build's tiles (x86_intrinsics.h)
#endif
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3) != 3) return false;  // XTILECFG and XTILEDATA state enabled by the OS
  // Linux hands out the 8 KiB tile state only on request (once per process; oneDNN asks too).
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// On unless KT_OPS_AMX=0 or oneDNN's cap leaves AMX out (cpu_isa.h); set_amx_enabled changes it.
std::atomic<bool>& amx_flag() {
  static std::atomic<bool> flag([] {
    const char* env = std::getenv("KT_OPS_AMX");
    return !(env != nullptr && std::string(env) == "0") && !onednn_cap_excludes_amx();
  }());
  return flag;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

KT_TARGET_AMX void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The compiler does not see the tile instructions' memory accesses (they are asm statements).
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }

// Per-thread buffers, kept across calls (each expert's GEMMs reuse them).
struct Buffers {
  std::vector<uint16_t> x_tiles, strip;
  alignas(64) float sums[kStrip * kStrip];
};
Buffers& thread_buffers() {
  thread_local Buffers b;
  return b;
}

// x [M, K] bf16 (row stride ldx) as 16-row tiles: tile (t, s) = rows 16t .., columns 32s .., at
// (t * steps + s) * 1 KiB, rows of 64 bytes; rows past M are zeros.
KT_TARGET_AMX void tile_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* tiles) {
  const int64_t steps = K / kStepCols, row_tiles = (M + kTileRows - 1) / kTileRows;
  for (int64_t t = 0; t < row_tiles; ++t) {
    for (int64_t r = 0; r < kTileRows; ++r) {
      const int64_t m = t * kTileRows + r;
      uint16_t* dst = tiles + t * steps * kTileValues + r * kStepCols;
      if (m >= M) {
        for (int64_t s = 0; s < steps; ++s) _mm512_storeu_si512(dst + s * kTileValues, _mm512_setzero_si512());
        continue;
      }
      const uint16_t* src = x + m * ldx;
      for (int64_t s = 0; s < steps; ++s) {
        _mm512_storeu_si512(dst + s * kTileValues, _mm512_loadu_si512(src + s * kStepCols));
      }
    }
  }
}

// A chunk of strips' weight values: 16-output blocks, each [steps][16 pairs][16 outputs][2], the
// PackedBf16Layout {out = chunk, in = steps * 32, out_block 16, in_block in}; strip j is blocks
// 2j and 2j + 1.
PackedBf16Layout chunk_layout(int64_t chunk, int64_t in) { return PackedBf16Layout{chunk, in, 16, in}; }

// Outputs dequantized per fill: x·wᵀ fills one strip (whole weight rows); d·w fills 128 columns
// (an fp8 block) of every row at once where the columns allow, since its kernel walks the rows
// and each row's segment costs a setup.
constexpr int64_t kChunkNn = 128;

// rows (at most 32) of out, 32 outputs each, = bf16(sums + addend): sums [32][32] float32 from
// multiply_strip, the addend (float32 or bf16, when given) with row stride ld_add.
KT_TARGET_AMX void store_strip(const float* sums, int64_t rows, at::BFloat16* out, int64_t ldo, const float* add_f32,
                               const at::BFloat16* add_bf16, int64_t ld_add) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 lo = _mm512_loadu_ps(sums + r * kStrip), hi = _mm512_loadu_ps(sums + r * kStrip + 16);
    if (add_f32 != nullptr) {
      lo = _mm512_add_ps(lo, _mm512_loadu_ps(add_f32 + r * ld_add));
      hi = _mm512_add_ps(hi, _mm512_loadu_ps(add_f32 + r * ld_add + 16));
    } else if (add_bf16 != nullptr) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(add_bf16 + r * ld_add);
      lo = _mm512_add_ps(lo, simd::load16_bf16(a));
      hi = _mm512_add_ps(hi, simd::load16_bf16(a + 16));
    }
    _mm512_storeu_si512(reinterpret_cast<void*>(out + r * ldo), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// The strip's sums for x row tiles t, t + 1 (two = false: t alone) over all steps: tiles of x
// at x_tiles + t * steps tiles, of the strip's two blocks at strip and strip + block.
KT_TARGET_AMX void multiply_strip(const uint16_t* x_tiles, int64_t steps, int64_t t, bool two, const uint16_t* strip,
                                  int64_t block, float* sums) {
  const uint16_t* x0 = x_tiles + t * steps * kTileValues;
  const uint16_t* x1 = x0 + steps * kTileValues;
  const uint16_t* b0 = strip;
  const uint16_t* b1 = strip + block;
  constexpr int64_t kRowBytes = 64;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(4, x0 + s * kTileValues, kRowBytes);
      _tile_loadd(5, x1 + s * kTileValues, kRowBytes);
      _tile_loadd(6, b0 + s * kTileValues, kRowBytes);
      _tile_loadd(7, b1 + s * kTileValues, kRowBytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  } else {
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(4, x0 + s * kTileValues, kRowBytes);
      _tile_loadd(6, b0 + s * kTileValues, kRowBytes);
      _tile_loadd(7, b1 + s * kTileValues, kRowBytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
  }
  constexpr int64_t kSumBytes = kStrip * sizeof(float);
  _tile_stored(0, sums, kSumBytes);
  _tile_stored(1, sums + 16, kSumBytes);
  if (two) {
    _tile_stored(2, sums + 16 * kStrip, kSumBytes);
    _tile_stored(3, sums + 16 * kStrip + 16, kSumBytes);
  }
  memory_barrier();
}

// out [M, N] (+ addend) = a·bᵀ, a [M, in] bf16, where fill(o0, strips) writes the `chunk`
// outputs from o0 (chunk / 32 strips side by side, chunk_layout(chunk, in)) of b.
template <typename Fill>
KT_TARGET_AMX at::Tensor amx_gemm(const at::Tensor& a, int64_t N, int64_t chunk,
                                  const std::optional<at::Tensor>& addend, const Fill& fill) {
  const int64_t M = a.size(0), in = a.size(1), steps = in / kStepCols;
  const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
  Buffers& buf = thread_buffers();
  buf.x_tiles.resize(row_tiles * steps * kTileValues);
  buf.strip.resize(chunk * in);
  tile_rows(reinterpret_cast<const uint16_t*>(a.const_data_ptr<at::BFloat16>()), a.stride(0), M, in,
            buf.x_tiles.data());
  at::Tensor out = at::empty({M, N}, a.options());
  at::Tensor add;
  const float* add_f32 = nullptr;
  const at::BFloat16* add_bf16 = nullptr;
  if (addend.has_value()) {
    TORCH_INTERNAL_ASSERT(addend->dim() == 2 && addend->size(0) == M && addend->size(1) == N);
    add = addend->scalar_type() == at::kBFloat16 ? addend->contiguous() : addend->to(at::kFloat).contiguous();
    if (add.scalar_type() == at::kFloat) add_f32 = add.const_data_ptr<float>();
    else add_bf16 = add.const_data_ptr<at::BFloat16>();
  }
  at::BFloat16* o = out.mutable_data_ptr<at::BFloat16>();
  configure_tiles();
  memory_barrier();
  for (int64_t o0 = 0; o0 < N; o0 += kStrip) {
    const uint16_t* strip = buf.strip.data() + (o0 % chunk) * in;
    if (o0 % chunk == 0) {
      fill(o0, buf.strip.data());
      memory_barrier();
    }
    for (int64_t t = 0; t < row_tiles; t += 2) {
      const bool two = t + 1 < row_tiles;
      multiply_strip(buf.x_tiles.data(), steps, t, two, strip, in * 16, buf.sums);
      const int64_t m0 = t * kTileRows, rows = std::min<int64_t>(2 * kTileRows, M - m0);
      const int64_t off = m0 * N + o0;
      store_strip(buf.sums, rows, o + m0 * N + o0, N, add_f32 ? add_f32 + off : nullptr,
                  add_bf16 ? add_bf16 + off : nullptr, N);
    }
  }
  _tile_release();
  return out;
}

}  // namespace

bool amx_bf16_supported() {
  static const bool supported = probe_amx_bf16();
  return supported;
}

bool amx_bf16_available() { return amx_flag().load() && amx_bf16_supported(); }

void set_amx_enabled(bool enabled) { amx_flag().store(enabled); }

namespace {

// The activations the AMX GEMMs take on the active path: bf16 rows, contiguous within each.
bool amx_takes_activations(const at::Tensor& a) {
  return a.scalar_type() == at::kBFloat16 && active_cpu_isa() == CpuIsa::kAvx512Bf16 && amx_bf16_available() &&
         a.dim() == 2 && a.size(0) > 0 && a.stride(1) == 1;
}

}  // namespace

bool amx_takes_mm_nt(const at::Tensor& x, const WeightMatrix& w) {
  return w.quantized() && amx_takes_activations(x) && x.size(1) == w.cols && w.rows % kStrip == 0 &&
         w.cols % kStepCols == 0 && w.cols > 0;
}

bool amx_takes_mm_nn(const at::Tensor& d, std::initializer_list<const WeightMatrix*> stacked) {
  if (!amx_takes_activations(d)) return false;
  const int64_t K = (*stacked.begin())->cols;
  int64_t rows = 0;
  for (const WeightMatrix* w : stacked) {
    if (!w->quantized() || w->cols != K || w->rows % kStepCols != 0) return false;
    rows += w->rows;
  }
  return rows == d.size(1) && K % kStrip == 0 && K > 0;
}

at::Tensor amx_mm_nt(const at::Tensor& x, const WeightMatrix& w) {
  TORCH_INTERNAL_ASSERT(amx_takes_mm_nt(x, w));
  const PackedBf16Layout l = chunk_layout(kStrip, w.cols);
  return amx_gemm(x, w.rows, kStrip, std::nullopt, [&](int64_t o0, uint16_t* strip) {
    dequantize_packed_rows(w, o0, l, strip, CpuIsa::kAvx512Bf16);
  });
}

at::Tensor amx_mm_nn(const at::Tensor& d, std::initializer_list<const WeightMatrix*> stacked,
                     const std::optional<at::Tensor>& addend) {
  TORCH_INTERNAL_ASSERT(amx_takes_mm_nn(d, stacked));
  const int64_t K = (*stacked.begin())->cols, chunk = K % kChunkNn == 0 ? kChunkNn : kStrip;
  const PackedBf16Layout l = chunk_layout(chunk, d.size(1));
  return amx_gemm(d, K, chunk, addend, [&](int64_t k0, uint16_t* strip) {
    int64_t in0 = 0;
    for (const WeightMatrix* w : stacked) {
      dequantize_packed_cols(*w, k0, l, strip, CpuIsa::kAvx512Bf16, in0);
      in0 += w->rows;
    }
  });
}

}  // namespace kt
