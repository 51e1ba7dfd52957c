#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models {

/// Which kernel `scaled_dot_product_attention` runs.
enum class AttentionKernel {
  kAuto,       ///< the fastest for this CPU, shape and dtype (the rule below)
  kFlash,      ///< LibTorch's kernel in the inputs' dtype (what PyTorch runs)
  kFlashFp32,  ///< LibTorch's kernel in fp32 on the exactly up-cast inputs, output rounded once
  kMatmul,     ///< mixprec's: two GEMMs with a fused softmax between them (CPU, no dropout)
};

/// `at::scaled_dot_product_attention` (causal or not, dropout; default scale) with the kernel
/// chosen for speed; on other devices and dtypes than fp32/bf16/fp16, LibTorch's kernel as is.
/// Every kernel returns the inputs' dtype. kFlashFp32 rounds once. kMatmul computes the scores
/// and their gradient in fp32 (GEMMs on the exact up-casts, as the flash kernels accumulate
/// them; for bf16, where oneDNN's bf16 brgemm runs without AMX, its fp32 sums of the exact
/// products, 32 query rows at a time and only the blocks a causal mask keeps), rounds the
/// probabilities to bf16 for the GEMMs with them as LibTorch's bf16 kernel does, and runs fp16
/// inputs in fp32 throughout. Tested against fp64 (attention_test.cpp):
/// for bf16, gradients as accurate as LibTorch's bf16 kernel, the output within 1.5x its error
/// (it rounds normalized probabilities where flash rounds exp(s - max), exactly 1 at the max).
/// kMatmul keeps the (B, heads, Lq, Lk) probabilities for backward (and, but for bf16 with
/// brgemm, makes the scores and their gradient in fp32 whole, for a moment), so kAuto picks it
/// for short sequences only.
///
/// kAuto's rule comes from forward + backward timings (ms, causal, 2 threads, LibTorch 2.13;
/// `build/bench/attention_bench --reps 11`). On the Xeon with AMX-BF16 this project ran on
/// first (flash kernels only; the matmul one came later and was not timed there):
///
///   (B, heads, T, head dim)   bf16   fp32 on bf16   fp16   fp32 on fp16
///   (8, 4, 128, 32)           5.1    1.7            5.7    2.0
///   (8, 8, 256, 64)           16.1   20.0           23.7   18.3
///   (8, 8, 512, 64)           44.3   69.9           86.5   70.6
///   (4, 12, 1024, 64)         87.7   151.8          148.5  138.4
///
/// On an AMD EPYC (Zen 5: AVX512-BF16, no AMX), flash / flash on fp32 / matmul (bf16 matmul
/// with brgemm; without it, before brgemm was used: 1.9, 22.3, 157, 462), since the kernels
/// run on both threads (OpenMP; before: matmul bf16 1.7, 17.7, 97, 294, fp32 1.9, 31.2, 143):
///
///   (B, heads, T, head dim)   fp32                bf16                fp16
///   (8, 4, 128, 32)           2.6 / 2.4 / 1.7     5.5 / 2.6 / 1.1     13.0 / 2.6 / 2.2
///   (8, 8, 256, 64)           31.0 / 29.3 / 26.0  31.1 / 29.1 / 12.1  181 / 29.6 / 30.0
///   (8, 8, 512, 64)           107 / 121 / 136     100 / 110 / 53      795 / 126 / 137
///   (4, 12, 1024, 64)         235 / 236 / 382     189 / 235 / 200     1678 / 230 / 391
///
/// (fp32 at T = 256 stays on flash: the matmul kernel's 16% here did not show in the large
/// GPT-2 fp32 step, 1.002x in 5 interleaved pairs, and it keeps the (B, heads, T, T) fp32
/// probabilities: 16 MB a layer there.)
///
/// So, with AMX-BF16 (LibTorch's bf16 kernels run on it): fp32 as is, fp16 in fp32, bf16 in
/// fp32 up to T = 128 and natively above. Without: kMatmul up to T = 128 in every dtype and in
/// bf16 up to 512 with brgemm, 256 without; above that fp32 and bf16 as is, fp16 in fp32 (and
/// bf16 in fp32 up to 256 where kMatmul cannot run, e.g. with dropout). T is the longer of
/// queries and keys. Under
/// autocast the kernels run with autocast off, so fp32 work is not cast back to 16 bits.
at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, double dropout_p, bool is_causal,
                                        AttentionKernel kernel = AttentionKernel::kAuto);

/// The kernel kAuto runs for these inputs on this CPU (the rule above).
AttentionKernel choose_attention_kernel(const at::Tensor& query, const at::Tensor& key,
                                        double dropout_p);

}  // namespace mixprec::models
