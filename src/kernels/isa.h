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
// Read once: CPUID traps to the hypervisor in a VM, and callers ask per op.
inline bool cpu_has_amx_bf16() {
#if defined(__x86_64__)
  static const bool amx = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && ((edx >> 22) & 1u);
  }();
  return amx;
#else
  return false;
#endif
}

// The build of a kernel that runs on this CPU: `avx512`, `avx2`, or `none` where neither does.
// (Callers name the x86 builds only where MIXPREC_HAVE_X86_KERNELS says they exist.)
template <typename K>
K for_this_cpu(K avx512, K avx2, K none) {
  switch (cpu_isa()) {
    case Isa::kAvx512:
      return avx512;
    case Isa::kAvx2:
      return avx2;
    default:
      return none;
  }
}

}  // namespace mixprec::kernels
