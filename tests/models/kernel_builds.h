// The builds of a kernel in src/*/kernels/ that its tests call one by one.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "kernels/isa.h"

namespace mixprec::testing {

/// Every build of a kernel that this CPU runs, as (name, its functions...): the AVX-512 one
/// where LibTorch runs AVX-512 code, and the AVX2 one there too (which the library never calls
/// on such a CPU) and on AVX2 CPUs. Callers name the builds only where MIXPREC_HAVE_X86_KERNELS
/// says they exist.
template <typename... F>
std::vector<std::tuple<std::string, F...>> kernel_builds(std::tuple<F...> avx512,
                                                         std::tuple<F...> avx2) {
  std::vector<std::tuple<std::string, F...>> builds;
  const auto isa = mixprec::kernels::cpu_isa();
  if (isa == mixprec::kernels::Isa::kAvx512)
    builds.push_back(std::tuple_cat(std::tuple<std::string>("avx512"), avx512));
  if (isa != mixprec::kernels::Isa::kNone)
    builds.push_back(std::tuple_cat(std::tuple<std::string>("avx2"), avx2));
  return builds;
}

}  // namespace mixprec::testing
