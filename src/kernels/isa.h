// Which build of the kernels in */kernels/ runs here: the one for
// LibTorch's CPU capability (so ATEN_CPU_CAPABILITY lowers it too).
#pragma once

#include <ATen/Version.h>

#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace mixprec::kernels {

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

// Whether the CPU has AMX-BF16 (CPUID leaf 7, EDX bit 22), on which LibTorch's own
// 16-bit kernels (oneDNN's) change speed class.
inline bool cpu_has_amx_bf16() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && ((edx >> 22) & 1u);
#else
  return false;
#endif
}

}  // namespace mixprec::kernels
