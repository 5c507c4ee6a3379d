// Which instruction sets are compiled in, which this CPU runs, and the best of them.
#include <cstdlib>
#include <cstring>

#include "qmv.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace lt {

#ifdef LT_HAVE_AVX512
namespace x86_avx512 {
extern const Kernels kernels;
}
#endif
#ifdef LT_HAVE_AVX2
namespace x86_avx2 {
extern const Kernels kernels;
}
#endif
#ifdef LT_HAVE_NEON
namespace neon {
extern const Kernels kernels;
}
#endif

const Kernels* const* compiled_kernels(int* n) {
  static const Kernels* const all[] = {
#ifdef LT_HAVE_AVX512
      &x86_avx512::kernels,
#endif
#ifdef LT_HAVE_AVX2
      &x86_avx2::kernels,
#endif
#ifdef LT_HAVE_NEON
      &neon::kernels,
#endif
      &scalar_kernels(),
  };
  *n = sizeof(all) / sizeof(all[0]);
  return all;
}

bool cpu_supports(const char* isa) {
  if (!std::strcmp(isa, "scalar")) return true;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  unsigned a, b, c, d;
  bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  if (!std::strcmp(isa, "avx2")) return avx2;
  if (!std::strcmp(isa, "avx512"))
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#endif
#if defined(__aarch64__)
  if (!std::strcmp(isa, "neon")) return true;  // baseline on arm64
#endif
  return false;
}

const Kernels& best_kernels() {
  static const Kernels* best = [] {
    int n;
    const Kernels* const* all = compiled_kernels(&n);
    for (int i = 0; i < n; i++)
      if (cpu_supports(all[i]->isa)) return all[i];
    return &scalar_kernels();
  }();
  return *best;
}

RowsFn rows_fn(const Kernels& k, int format) {
  int s = slot(format);
  if (s < 0) return nullptr;
  return k.rows[s] ? k.rows[s] : scalar_kernels().rows[s];
}

}  // namespace lt
