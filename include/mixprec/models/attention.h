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
/// them), rounds the probabilities to bf16 for the GEMMs with them as LibTorch's bf16 kernel
/// does, and runs fp16 inputs in fp32 throughout. For bf16, where oneDNN's bf16 brgemm runs
/// (head dims and keys even, no broadcast batch dims; on AMX too), all six GEMMs are brgemm's
/// fp32 sums of the exact products, 32 rows at a time and only the blocks a causal mask keeps
/// (about half); they read the inputs where they are when each row is contiguous (a model's
/// heads, views of its projection), and give the output and the gradients dense, in the
/// inputs' dim order (for heads of a (B, T, heads, head dim) tensor, merging them is a view).
/// Tested against fp64 (attention_test.cpp): for bf16, the output within 1.5x the error of
/// LibTorch's bf16 kernel (it rounds normalized probabilities where flash rounds exp(s - max),
/// exactly 1 at the max), the gradients within 2x (its backward reads the probabilities
/// rounded where flash recomputes them in fp32; both about one bf16 rounding).
/// kMatmul is differentiable once (a backward through it with create_graph is an error).
/// kMatmul keeps the (B, heads, Lq, Lk) probabilities for backward (and, but for bf16 with
/// brgemm, makes the scores and their gradient in fp32 whole, for a moment), so kAuto picks it
/// for short sequences only.
///
/// kAuto's rule comes from forward + backward timings (ms, causal, 2 threads, LibTorch 2.13;
/// `build/bench/attention_bench --reps 11`). On an Intel Xeon with AMX-BF16 and AVX512-FP16
/// (the code of this rule, one run), flash / flash on fp32 / matmul; bf16 matmul runs its
/// GEMMs on brgemm, as on the EPYC below:
///
///   (B, heads, T, head dim)   fp32                 bf16                fp16
///   (8, 4, 128, 32)           1.7 / 1.5 / 1.1      5.2 / 1.7 / 0.6     5.6 / 1.5 / 1.3
///   (8, 8, 256, 64)           20.0 / 18.2 / 12.7   16.4 / 18.8 / 5.5   25.6 / 19.5 / 15.0
///   (8, 8, 512, 64)           68.7 / 68.5 / 115    47.7 / 78.5 / 34.5  84.1 / 75.3 / 120
///   (4, 12, 1024, 64)         140 / 143 / 325      94.1 / 148 / 93.0   157 / 148 / 330
///
/// On an AMD EPYC without AMX (AVX512-BF16), flash / flash on fp32 / matmul. The Zen 4 these
/// figures come from (the code of `e8b0985`, one run) is noisy: fp32 flash and "flash on
/// fp32" are the same kernel, 8% and 6% apart here. docs/speed.md's before/after figures for
/// each change to the bf16 matmul kernel were taken on a Zen 5, at their commits: ending at
/// 0.8-0.9, 8.2-8.8, 28.5-41 and 113-118 ms, from 1.9, 22.3, 157 and 462 before brgemm.
///
///   (B, heads, T, head dim)   fp32                bf16                fp16
///   (8, 4, 128, 32)           3.9 / 3.6 / 2.4     8.6 / 4.1 / 1.1     19.4 / 4.2 / 3.3
///   (8, 8, 256, 64)           41.0 / 43.9 / 50.8  42.5 / 41.7 / 11.1  375 / 39.5 / 36.4
///   (8, 8, 512, 64)           146 / 137 / 150     117 / 119 / 28.3    795 / 113 / 145
///   (4, 12, 1024, 64)         224 / 225 / 385     184 / 244 / 127     1718 / 246 / 400
///
/// (fp32 at T = 256 stays on flash: the matmul kernel's 16% on the Zen 5 did not show in the
/// large GPT-2 fp32 step, 1.002x in 5 interleaved pairs, it is 24% slower in the run above,
/// and it keeps the (B, heads, T, T) fp32 probabilities: 16 MB a layer there. On the Xeon it
/// is faster, but the large GPT-2 fp32 step gained 0-5% in 3 pairs for 22% more peak RSS.
/// fp16 at T = 256 stays on flash on fp32 for the same reason: kMatmul runs it in fp32, with
/// the same fp32 probabilities. bf16 at T = 1024 stays on flash too, though matmul is 1.45-1.6x
/// faster on the EPYC: its probabilities would be 96 MB a layer.)
///
/// So: kMatmul up to T = 128 in every dtype and in bf16 up to 512 with brgemm, 256 without;
/// above that fp32 and bf16 as is, fp16 in fp32 (and where kMatmul cannot run, e.g. with
/// dropout, bf16 in fp32 up to 256, or 128 with AMX-BF16, where LibTorch's bf16 flash kernel is
/// the faster above). T is the longer of queries and keys. Under autocast, kMatmul and
/// kFlashFp32 run with autocast off, so their fp32 work is not cast back to 16 bits; kFlash is
/// LibTorch's SDPA, which autocast casts as it does in PyTorch.
at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, double dropout_p, bool is_causal,
                                        AttentionKernel kernel = AttentionKernel::kAuto);

/// GPT-2's self-attention on its packed projection: qkv (B, T, 3 C) holds the queries, keys and
/// values of n_head heads side by side (c_attn's output); the result is (B, T, C), the heads'
/// outputs side by side (what c_proj takes). The same as splitting qkv in three, viewing each
/// as (B, n_head, T, C / n_head) heads, `scaled_dot_product_attention` (kAuto) and merging the
/// heads, which is what runs unless kAuto picks kMatmul on its bf16 brgemm kernels: there the
/// kernels read the heads where they are and write the output and the gradients where the
/// merge and qkv's gradient have them, so that neither the merge nor the split's backward (a
/// cat of the three gradients) copies them.
at::Tensor packed_self_attention(const at::Tensor& qkv, int64_t n_head, double dropout_p,
                                 bool is_causal);

/// The kernel kAuto runs for these inputs on this CPU (the rule above).
AttentionKernel choose_attention_kernel(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, double dropout_p);

}  // namespace mixprec::models
