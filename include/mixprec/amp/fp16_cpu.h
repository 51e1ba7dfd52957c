#pragma once

#include <cstdint>

namespace mixprec::amp {

/// When fp16 matmul-class ops on the CPU take mixprec's fast path.
enum class Fp16CpuPath {
  kAuto,    ///< only on CPUs without native FP16 arithmetic (AVX512-FP16, AMX-FP16)
  kAlways,  ///< on every CPU (tests, comparisons)
  kNever,   ///< LibTorch's own fp16 kernels everywhere
};

/// fp16 GEMMs at fp32 speed on CPUs without FP16 arithmetic.
///
/// There, LibTorch's fp16 `mm`/`bmm`/convolutions are scalar loops, 5-180x slower
/// than fp32. The fast path computes `mm`, `addmm`, `bmm`, `baddbmm`, `mv`,
/// `addmv`, `dot`, `vdot`, `convolution` and CPU flash attention (and so
/// `matmul`, `linear`, `conv1d/2d/3d`, `conv_transpose*`, `einsum`,
/// `scaled_dot_product_attention`, and the backward of each) on the fp16 inputs
/// up-cast exactly to fp32, with fp32 accumulation, rounded once to fp16: the
/// numerics of GPU tensor cores. (The fp32 GEMM of `mm`, and of a linear layer's
/// `addmm` (a 1-D bias, beta = alpha = 1), is oneDNN's for a row-major first
/// operand where it runs, as in `models::linear`; LibTorch's elsewhere.) Activations
/// and gradients stay fp16, so fp16 underflow and overflow, and loss scaling, behave as on a GPU.
///
/// The kernels are installed in the process on first use of fp16 autocast on
/// the CPU (`Autocast(kCPU, kHalf)`), or by `set_fp16_cpu_path(kAlways)`; a
/// program that never asks for fp16 runs LibTorch's kernels untouched.
/// Once installed they also serve fp16 tensors outside autocast (a model cast
/// with `->to(torch::kHalf)`). Other dtypes always go to LibTorch's kernels.
///
/// Not covered: the out= and in-place forms of these GEMMs (`addmm_`,
/// `mm.out`, `baddbmm_`, `addmv_`, ...), `addbmm` and `_addmm_activation`.
/// They keep LibTorch's fp16 kernels (never an fp32 computation in disguise);
/// while the fast path is on, the first fp16 call of each prints one warning
/// (`TORCH_WARN`) naming the op.
void set_fp16_cpu_path(Fp16CpuPath path);
Fp16CpuPath fp16_cpu_path();

/// Whether this CPU has native FP16 arithmetic (cpuinfo, through ATen).
bool cpu_has_native_fp16();

/// Whether fp16 ops on the CPU take the fast path now: kernels installed and
/// the path setting (with this CPU) says so.
bool fp16_cpu_fast_path_active();

/// Installs the fast-path kernels if the path setting can use them on this CPU.
/// Idempotent and thread-safe; called by `Autocast(kCPU, kHalf)`.
void maybe_install_fp16_cpu_fast_path();

/// How many op calls took the fast path in this process (for tests and reports).
int64_t fp16_cpu_fast_path_calls();

}  // namespace mixprec::amp
