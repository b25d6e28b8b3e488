#include "platform/large_alloc.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace kt {
namespace {

#ifdef __linux__
constexpr size_t kHugePage = size_t(2) << 20;

// KT_OPS_HUGE_PAGES=0 turns the huge-page advice off (fresh mappings stay).
bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KT_OPS_HUGE_PAGES");
    return !(env && std::string(env) == "0");
  }();
  return enabled;
}

size_t cache_budget_bytes() {
  static const size_t budget = [] {
    if (const char* env = std::getenv("KT_OPS_BUFFER_CACHE_MB")) {
      char* end = nullptr;
      const long long mb = std::strtoll(env, &end, 10);
      TORCH_CHECK(end != env && *end == '\0' && mb >= 0,
                  "KT_OPS_BUFFER_CACHE_MB must be a whole number of MiB >= 0, got '", env, "'");
      return size_t(mb) << 20;
    }
    return size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE)) / 4;
  }();
  return budget;
}

// One mmap: [base, base + mapped) with the 2 MiB aligned [data, data + bytes) inside (bytes:
// its capacity; a tensor on it may use less).
struct Mapping {
  void* base;
  size_t mapped;
  char* data;
  size_t bytes;
};

// Buffers handed out (by data address, for zero_large) and idle ones kept for reuse (by size).
// Never destroyed: tensors may be freed after static destructors have run.
class BufferCache {
 public:
  static BufferCache& get() {
    static BufferCache* cache = new BufferCache();
    return *cache;
  }

  // A mapping of at least `bytes` (a multiple of 2 MiB): the smallest idle one that is at
  // most a quarter larger (batches of varying length ask for varying sizes), else a fresh one
  // (data == nullptr when mmap fails).
  Mapping take(size_t bytes) {
    cache_budget_bytes();  // a bad KT_OPS_BUFFER_CACHE_MB raises here, in the op, not in a deleter
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = idle_.lower_bound(bytes);
      if (it != idle_.end() && it->first <= bytes + bytes / 4) {
        const Mapping m = it->second.mapping;
        idle_bytes_ -= m.bytes;
        idle_.erase(it);
        live_.emplace(reinterpret_cast<uintptr_t>(m.data), m);
        return m;
      }
    }
    const size_t mapped = bytes + kHugePage;  // slack to align the start to 2 MiB
    void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return {nullptr, 0, nullptr, 0};
    const uintptr_t start = (reinterpret_cast<uintptr_t>(base) + kHugePage - 1) / kHugePage * kHugePage;
    const Mapping m{base, mapped, reinterpret_cast<char*>(start), bytes};
    if (huge_pages_enabled()) madvise(m.data, bytes, MADV_HUGEPAGE);  // advice: failure is harmless
    std::lock_guard<std::mutex> lock(mu_);
    live_.emplace(start, m);
    return m;
  }

  // A tensor's storage was freed: keep its mapping, unmapping the longest-idle ones while the
  // idle mappings exceed the budget (this one too, if it alone does).
  void give_back(char* data) {
    std::vector<Mapping> unmap;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(reinterpret_cast<uintptr_t>(data));
      TORCH_INTERNAL_ASSERT(it != live_.end());
      idle_.emplace(it->second.bytes, Idle{it->second, ++clock_});
      idle_bytes_ += it->second.bytes;
      live_.erase(it);
      while (idle_bytes_ > cache_budget_bytes()) {
        auto oldest = idle_.begin();
        for (auto i = idle_.begin(); i != idle_.end(); ++i) {
          if (i->second.since < oldest->second.since) oldest = i;
        }
        unmap.push_back(oldest->second.mapping);
        idle_bytes_ -= oldest->second.mapping.bytes;
        idle_.erase(oldest);
      }
    }
    for (const Mapping& m : unmap) munmap(m.base, m.mapped);
  }

  // Whether [p, p + n) lies inside a buffer handed out.
  bool owns(const char* p, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(reinterpret_cast<uintptr_t>(p));
    if (it == live_.begin()) return false;
    const Mapping& m = std::prev(it)->second;
    return p >= m.data && p + n <= m.data + m.bytes;
  }

  void release_idle() {
    std::multimap<size_t, Idle> idle;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle.swap(idle_);
      idle_bytes_ = 0;
    }
    for (const auto& kv : idle) munmap(kv.second.mapping.base, kv.second.mapping.mapped);
  }

  std::vector<int64_t> idle_info() {
    std::lock_guard<std::mutex> lock(mu_);
    return {int64_t(idle_.size()), int64_t(idle_bytes_)};
  }

 private:
  struct Idle {
    Mapping mapping;
    uint64_t since;  // clock_ when it became idle
  };
  std::mutex mu_;
  std::map<uintptr_t, Mapping> live_;
  std::multimap<size_t, Idle> idle_;  // by capacity
  size_t idle_bytes_ = 0;
  uint64_t clock_ = 0;
};
#endif

}  // namespace

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
#ifdef __linux__
  const size_t bytes = c10::multiply_integers(sizes) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (options.device().is_cpu() && bytes >= kLargeMinBytes) {
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    const Mapping m = BufferCache::get().take(rounded);
    if (m.data != nullptr) {
      char* data = m.data;
      return at::from_blob(data, sizes, [data](void*) { BufferCache::get().give_back(data); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

void zero_large(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && t.device().is_cpu());
#ifdef __linux__
  char* p = static_cast<char*>(t.data_ptr());
  const size_t n = t.nbytes();
  static const size_t page = size_t(sysconf(_SC_PAGESIZE));
  if (n >= 2 * page && BufferCache::get().owns(p, n)) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + n;
    const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
    std::memset(p, 0, first - begin);
    std::memset(reinterpret_cast<char*>(last), 0, end - last);
    // Private anonymous memory reads as zeros after MADV_DONTNEED (guaranteed by Linux).
    if (madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) == 0) return;
    std::memset(reinterpret_cast<char*>(first), 0, last - first);
    return;
  }
#endif
  t.zero_();
}

void release_cached_buffers() {
#ifdef __linux__
  BufferCache::get().release_idle();
#endif
}

std::vector<int64_t> cached_buffers_info() {
#ifdef __linux__
  return BufferCache::get().idle_info();
#else
  return {0, 0};
#endif
}

}  // namespace kt
