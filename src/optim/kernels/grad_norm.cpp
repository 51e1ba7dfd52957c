// Built once per instruction set (CMakeLists.txt). Blocks run in parallel only
// when there are enough of them to pay for waking the threads; each block's
// sum has a fixed place, so the result is the same for any thread count.
#include "optim/kernels/grad_norm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <numeric>

namespace mixprec::optim::kernels::MIXPREC_KERNEL_ISA {
namespace {

template <typename F>
void for_each_block(const std::vector<std::span<float>>& blocks, F f) {
  const auto n = static_cast<int64_t>(blocks.size());
  size_t elements = 0;
  for (const auto& block : blocks) elements += block.size();
  const bool parallel = elements >= 2 * static_cast<size_t>(kGradNormBlock);
  at::parallel_for(0, n, parallel ? 1 : n, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) f(b, blocks[b]);
  });
}

}  // namespace

double sum_of_squares(const std::vector<std::span<float>>& blocks) {
  // GCC's vector types (they stay in registers): four vectors of eight fp32 partial sums, so
  // that the adds do not wait on each other, each summing at most 32 squares before it is
  // added to a double sum (a double pass is twice the work, and in cache that shows).
  using Floats = float __attribute__((vector_size(32)));
  using Doubles = double __attribute__((vector_size(64)));
  constexpr size_t kChunk = 1024;
  std::vector<double> sums(blocks.size());
  for_each_block(blocks, [&](int64_t b, std::span<float> x) {
    const auto add_squares = [&](Floats& partial, size_t i) {
      Floats f;
      std::memcpy(&f, &x[i], sizeof f);
      partial += f * f;
    };
    Doubles total{};
    const size_t whole = x.size() - x.size() % 32;
    size_t i = 0;
    while (i < whole) {
      Floats p0{}, p1{}, p2{}, p3{};
      for (const size_t end = std::min(whole, i + kChunk); i < end; i += 32) {
        add_squares(p0, i);
        add_squares(p1, i + 8);
        add_squares(p2, i + 16);
        add_squares(p3, i + 24);
      }
      total += __builtin_convertvector(p0, Doubles) + __builtin_convertvector(p1, Doubles) +
               __builtin_convertvector(p2, Doubles) + __builtin_convertvector(p3, Doubles);
    }
    double sum = 0;
    for (; i < x.size(); ++i) sum += static_cast<double>(x[i]) * x[i];
    for (size_t lane = 0; lane < 8; ++lane) sum += total[lane];
    sums[b] = sum;
  });
  return std::accumulate(sums.begin(), sums.end(), 0.0);
}

void scale(const std::vector<std::span<float>>& blocks, float factor) {
  for_each_block(blocks, [&](int64_t, std::span<float> x) {
#pragma omp simd
    for (size_t i = 0; i < x.size(); ++i) x[i] *= factor;
  });
}

}  // namespace mixprec::optim::kernels::MIXPREC_KERNEL_ISA
