// Which build of the kernels in models/kernels/ runs here: the one for
// LibTorch's CPU capability (so ATEN_CPU_CAPABILITY lowers it too).
#pragma once

#include <ATen/Version.h>

#include <string>

namespace mixprec::models::kernels {

enum class Isa { kNone, kAvx2, kAvx512 };

inline Isa cpu_isa() {
#ifdef MIXPREC_HAVE_X86_KERNELS
  static const Isa isa = [] {
    const std::string capability = at::get_cpu_capability();
    return capability == "AVX512" ? Isa::kAvx512 : capability == "AVX2" ? Isa::kAvx2 : Isa::kNone;
  }();
  return isa;
#else
  return Isa::kNone;
#endif
}

}  // namespace mixprec::models::kernels
