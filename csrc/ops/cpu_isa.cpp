#include "ops/cpu_isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace kt {
namespace {

bool cpu_supports(CpuIsa isa) {
  // __builtin_cpu_supports also checks that the OS saves the AVX/AVX-512 register state.
  switch (isa) {
    case CpuIsa::kPortable:
      return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::kAvx512:
      return cpu_supports(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
    case CpuIsa::kAvx512Bf16:
      return cpu_supports(CpuIsa::kAvx512) && __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

CpuIsa initial_cpu_isa() {
  const char* env = std::getenv("KT_OPS_CPU_ISA");
  return env ? parse_cpu_isa(env, "environment variable KT_OPS_CPU_ISA") : best_cpu_isa();
}

std::atomic<int>& active() {
  static std::atomic<int> isa{static_cast<int>(initial_cpu_isa())};
  return isa;
}

}  // namespace

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512Bf16, CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (cpu_supports(isa)) return isa;
  }
  return CpuIsa::kPortable;
}

CpuIsa active_cpu_isa() { return static_cast<CpuIsa>(active().load(std::memory_order_relaxed)); }

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kPortable: return "portable";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

CpuIsa parse_cpu_isa(const std::string& name, const char* what) {
  if (name == "auto" || name.empty()) return best_cpu_isa();
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (name == cpu_isa_name(isa)) {
      TORCH_CHECK(cpu_supports(isa), what, ": this CPU cannot run the '", name,
                  "' kernels; the best it supports is '", cpu_isa_name(best_cpu_isa()), "'");
      return isa;
    }
  }
  TORCH_CHECK_VALUE(false, what, ": expected one of auto, portable, avx2, avx512, avx512_bf16, got '",
                    name, "'");
}

void set_active_cpu_isa(CpuIsa isa) {
  TORCH_CHECK(cpu_supports(isa), "this CPU cannot run the '", cpu_isa_name(isa), "' kernels");
  active().store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace kt
