#pragma once
// Start-up of the CPU backend's runtime (OpenBLAS, OpenMP), called first thing
// in every program's main.
//
// Why: OpenBLAS picks its kernels when it is loaded, from the CPU model. The
// Debian OpenBLAS (0.3.21) does not know recent Xeons (e.g. family 6 model
// 207) and falls back to its SSE3 "Prescott" kernels, 3-5x slower than the
// AVX-512 ones the CPU runs. It reads OPENBLAS_CORETYPE only at load time, so
// when it chose a core weaker than the CPU's instruction set and the user did
// not set OPENBLAS_CORETYPE, the program re-executes itself once with
// OPENBLAS_CORETYPE set (SkylakeX for AVX-512, Haswell for AVX2). Setting
// OPENBLAS_CORETYPE yourself turns this off.

#include <string>

namespace kdn::engine {

// May not return (re-exec); argv must be main's.
void PrepareCpuRuntime(char** argv);

// The OpenBLAS core in use, e.g. "SkylakeX".
std::string BlasCoreName();

}  // namespace kdn::engine
