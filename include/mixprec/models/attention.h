#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models {

/// In which precision `scaled_dot_product_attention` computes 16-bit inputs.
enum class AttentionPrecision {
  kAuto,    ///< the faster of the two on this shape and dtype (the rule below)
  kNative,  ///< LibTorch's kernel in the inputs' dtype (what PyTorch runs)
  kFp32,    ///< LibTorch's kernel in fp32 on the exactly up-cast inputs, output rounded once
};

/// `at::scaled_dot_product_attention` (causal or not, dropout) where the precision of 16-bit
/// CPU inputs is chosen for speed; fp32 inputs and other devices always run LibTorch's kernel
/// as is. The output has the inputs' dtype either way, and kFp32 is at least as accurate
/// (it rounds once, where the 16-bit kernel rounds its intermediate blocks).
///
/// The kAuto rule, from forward + backward timings of LibTorch 2.13's CPU flash attention on
/// this project's machine (Xeon with AVX512-BF16/FP16 and AMX-BF16, 2 threads; causal, ms):
///
///   (B, heads, T, head dim)   bf16   fp32 on bf16   fp16   fp32 on fp16
///   (8, 4, 128, 32)           5.1    1.7            5.7    2.0
///   (8, 8, 256, 64)           16.1   20.0           23.7   18.3
///   (8, 8, 512, 64)           44.3   69.9           86.5   70.6
///   (4, 12, 1024, 64)         87.7   151.8          148.5  138.4
///
/// so fp16 always runs in fp32, and bf16 runs in fp32 up to T = 128 (the 16-bit kernels' fixed
/// costs dominate short sequences) and natively above. Under autocast the fp32 call is made
/// with autocast off for that op, so it is not cast back to 16 bits.
at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, double dropout_p, bool is_causal,
                                        AttentionPrecision precision = AttentionPrecision::kAuto);

}  // namespace mixprec::models
