#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace mixprec::models {

/// Mean cross-entropy of `logits` (N, C) against class indices `targets` (N), rows whose target
/// is `ignore_index` left out of the mean: the value and gradient of `at::cross_entropy_loss`
/// (no weights, no label smoothing). bf16/fp16 logits are treated as HF's causal-LM loss treats
/// them (`logits.float()` first): the loss is fp32 and the gradient is computed in fp32 and
/// rounded once to the logits' dtype, but no fp32 copy of the logits is made. fp32/fp64 logits
/// give a loss of their dtype. If every row is ignored, the loss is NaN, as LibTorch's is.
///
/// On the CPU (fp32, bf16, fp16; AVX2 or AVX-512) it runs mixprec's kernels: one pass over the
/// logits forward, one backward (writing the gradient), keeping only the logits and one fp32
/// per row. LibTorch's loss keeps (N, C) log-probabilities and its backward goes through a
/// zero-filled gradient and a log-softmax backward; HF's adds the fp32 copy and its cast back.
/// Elsewhere, LibTorch's ops (log-softmax, then a fused softmax-minus-one-hot backward).
/// Targets other than `ignore_index` must be in [0, C). Differentiable once.
///
/// With `num_items` (HF's `num_items_in_batch`), the loss is the sum over the rows that count
/// divided by `num_items` instead of their number, as HF's causal-LM loss: the Trainer passes
/// the label tokens of a whole accumulation window, so that every token weighs the same.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                         int64_t ignore_index = -100,
                         std::optional<int64_t> num_items = std::nullopt);

}  // namespace mixprec::models
