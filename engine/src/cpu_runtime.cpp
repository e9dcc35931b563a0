#include "kdn/engine/cpu_runtime.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "kdn/common/log.h"

namespace kdn::engine {

// Declared by OpenBLAS's cblas.h in newer releases only.
extern "C" char* openblas_get_corename(void);

std::string BlasCoreName() { return openblas_get_corename(); }

void PrepareCpuRuntime(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::string core = BlasCoreName();
  const char* want = nullptr;
#if defined(__x86_64__)
  const bool has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512cd");
  const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // The cores OpenBLAS falls back to when it does not recognise the CPU.
  const bool generic = core == "Prescott" || core == "Core2" || core == "Nehalem" ||
                       core == "Sandybridge" || core == "Dunnington" || core == "Penryn";
  if (generic && has_avx512) {
    want = "SkylakeX";
  } else if (generic && has_avx2) {
    want = "Haswell";
  }
#endif
  if (want == nullptr) return;
  ::setenv("OPENBLAS_CORETYPE", want, 1);
  ::execv("/proc/self/exe", argv);
  // exec failed (no /proc?): carry on with the slower kernels.
  LogWarn("OpenBLAS runs its {} kernels; set OPENBLAS_CORETYPE={}", core, want);
}

}  // namespace kdn::engine
