// Which packed layout (kernels/packed_bf16_layout.h) oneDNN uses for a bf16 weight's shape, as a
// target the quantized GEMMs dequantize into (dequantize_packed.h).
//
// at::mm re-packs a plain weight operand into the layout of oneDNN's kernels on every call:
// 10-25% of a [64, 2048]·[2048, 1536] bf16 GEMM here (AVX512-BF16 Zen 4, one thread). Panels
// dequantized straight into that layout skip the re-pack, as bf16 experts skip it on their
// packed copies (packed_weights.h); and packed panels of 256 rows ran within 3-7% of one GEMM
// on the whole [1536, 2048] weight, where plain panels of 256 rows ran 5-15% slower.
//
// The layout is oneDNN's choice (it differs between CPUs: AMX kernels block differently), so
// it is probed once per shape: oneDNN packs two coded matrices (value = row mod 251 + 1 and
// column mod 241 + 1, exact in bf16) and each candidate of the family below is checked against
// every packed element. A shape oneDNN packs otherwise, or with padding, has no layout here,
// and its callers keep plain panels. Only on the avx512_bf16 path (native_bf16_gemms()),
// where oneDNN's bf16 reorder runs at all.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/packed_bf16_layout.h"

namespace kt {

// The layout oneDNN packs a [out, in] bf16 weight in, or nullptr: another layout, padding, a
// shape the kernels do not tile (out a multiple of 16 and in of 32, and the blocks too), or
// not the avx512_bf16 path. Probed once per shape; thread-safe.
const PackedBf16Layout* packed_bf16_layout(int64_t out, int64_t in);

// A packed [out, in] bf16 weight owned by the calling thread (one per shape, made on first
// use and kept), for the caller to overwrite through packed_bf16_data and multiply with
// packed_linear (packed_weights.h) before it overwrites it again.
const at::Tensor& thread_packed_weight(int64_t out, int64_t in);

// The bf16 values of a packed weight (an MKLDNN-layout tensor), in its layout.
uint16_t* packed_bf16_data(const at::Tensor& packed);

}  // namespace kt
