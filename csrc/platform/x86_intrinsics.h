// The x86 intrinsics the kernels use: the compiler's own, or, in the test build that runs the AVX-512 kernels on
// CPUs without AVX-512 (KT_OPS_EMULATE_AVX512: tests/avx512_emulation.py), SIMDe's portable AVX-512 under the
// intrinsics' own names (avx512_emulation.h). Every kernel file includes this instead of <immintrin.h>.
#pragma once

#include <immintrin.h>

#ifdef KT_OPS_EMULATE_AVX512
#include "platform/avx512_emulation.h"
#endif
