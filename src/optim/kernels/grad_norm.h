// The two passes of clip_grad_norm_ on fp32 gradients (optim/clip_grad.cpp),
// one namespace per instruction set they are built for. A block is a run of
// at most kGradNormBlock elements of one gradient.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace mixprec::optim::kernels {

inline constexpr int64_t kGradNormBlock = int64_t{1} << 16;

namespace avx2 {
// The sum of the squares of all elements, in double, block by block in order.
double sum_of_squares(const std::vector<std::span<float>>& blocks);
void scale(const std::vector<std::span<float>>& blocks, float factor);
}  // namespace avx2
namespace avx512 {
double sum_of_squares(const std::vector<std::span<float>>& blocks);
void scale(const std::vector<std::span<float>>& blocks, float factor);
}  // namespace avx512
}  // namespace mixprec::optim::kernels
