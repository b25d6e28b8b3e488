#include "platform/cpu_isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <string>

namespace kt {
namespace {

// oneDNN honours a cap on its own instruction set: ONEDNN_MAX_CPU_ISA (formerly
// DNNL_MAX_CPU_ISA), as the user wrote it, or nullptr when unset.
const char* onednn_cap() {
  static const char* const cap = [] {
    const char* v = std::getenv("ONEDNN_MAX_CPU_ISA");
    return v != nullptr ? v : std::getenv("DNNL_MAX_CPU_ISA");
  }();
  return cap;
}

// That cap upper-cased ("" when unset), as oneDNN compares it.
const std::string& onednn_cap_upper() {
  static const std::string upper = [] {
    std::string s(onednn_cap() != nullptr ? onednn_cap() : "");
    for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return s;
  }();
  return upper;
}

// The avx512_bf16 path runs oneDNN's native bf16 GEMMs and packs weights for them; below
// AVX512_CORE_BF16 oneDNN's bf16 GEMMs fall back to slow code and its weight reorder refuses
// bf16 ("needs the cpu support avx_ne_convert or avx512bw, ..."): seen on a Zen 4 under the AVX2
// emulation recipe. Then the path is unavailable, as on a CPU without AVX512-BF16. The cap as
// written, or nullptr when it leaves bf16 in.
const char* onednn_cap_below_bf16() {
  for (const char* below : {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}) {
    if (onednn_cap_upper() == below) return onednn_cap();
  }
  return nullptr;
}

// Whether the CPU (and the OS, which must save the vector registers) has the path's
// instructions, whatever oneDNN is allowed to use.
bool cpu_has_instructions(CpuIsa isa) {
#ifdef KT_OPS_EMULATE_AVX512
  // The test build runs its AVX-512 kernels on AVX2 (x86_intrinsics.h).
  if (isa == CpuIsa::kAvx512 || isa == CpuIsa::kAvx512Bf16) isa = CpuIsa::kAvx2;
#endif
  // __builtin_cpu_supports also checks that the OS saves the AVX/AVX-512 register state.
  switch (isa) {
    case CpuIsa::kPortable:
      return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::kAvx512:
      return cpu_has_instructions(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
    case CpuIsa::kAvx512Bf16:
      return cpu_has_instructions(CpuIsa::kAvx512) && __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

bool cpu_supports(CpuIsa isa) {
  return cpu_has_instructions(isa) && (isa != CpuIsa::kAvx512Bf16 || onednn_cap_below_bf16() == nullptr);
}

// Why a path the CPU has is still unavailable ("" when the CPU lacks it: then the cap is not
// the reason, and naming it would send the user after the wrong cause).
std::string unsupported_note(CpuIsa isa) {
  if (isa != CpuIsa::kAvx512Bf16 || !cpu_has_instructions(isa) || onednn_cap_below_bf16() == nullptr) return "";
  return std::string(" (oneDNN is limited to ONEDNN_MAX_CPU_ISA=") + onednn_cap_below_bf16() +
         ", below the AVX512_CORE_BF16 its bf16 GEMMs and weight packing need)";
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

bool onednn_cap_excludes_amx() {
  const std::string& cap = onednn_cap_upper();
  return !cap.empty() && cap != "ALL" && cap.find("AMX") == std::string::npos;
}

// The test build that emulates AVX-512 (x86_intrinsics.h) offers every extension its kernels use.
#ifdef KT_OPS_EMULATE_AVX512
#define KT_CPU_HAS(feature) true
#else
#define KT_CPU_HAS(feature) __builtin_cpu_supports(feature)
#endif

bool cpu_has_avx512_vbmi() {
  static const bool has = KT_CPU_HAS("avx512vbmi");
  return has;
}

bool cpu_has_avx512_vnni() {
  static const bool has = KT_CPU_HAS("avx512vnni");
  return has;
}

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
      TORCH_CHECK(cpu_supports(isa), what, ": this CPU cannot run the '", name, "' kernels",
                  unsupported_note(isa), "; the best it supports is '", cpu_isa_name(best_cpu_isa()), "'");
      return isa;
    }
  }
  TORCH_CHECK_VALUE(false, what, ": expected one of auto, portable, avx2, avx512, avx512_bf16, got '",
                    name, "'");
}

void set_active_cpu_isa(CpuIsa isa) {
  TORCH_CHECK(cpu_supports(isa), "this CPU cannot run the '", cpu_isa_name(isa), "' kernels", unsupported_note(isa));
  active().store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace kt
