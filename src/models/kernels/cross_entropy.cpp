// Cross-entropy on (N, C) logits in two passes over them, forward and backward,
// on LibTorch's vector types and thread pool: no log-probabilities, no fp32
// copy of 16-bit logits, no separate cast of the gradient. Built once per
// instruction set (CMakeLists.txt); models/cross_entropy.cpp picks one at run
// time.
#include "models/kernels/cross_entropy.h"
#include "kernels/dispatch.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>

namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;

// Rows per task: about 32k elements.
int64_t grain(int64_t C) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(C, 1)); }

}  // namespace

void cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets,
                           int64_t ignore_index, const at::Tensor& lse, const at::Tensor& loss) {
  const int64_t N = logits.size(0), C = logits.size(1);
  mixprec::kernels::dispatch_float_types(logits.scalar_type(), "cross_entropy", [&](auto zero) {
    using T = decltype(zero);
    const auto* x = logits.const_data_ptr<T>();
    const auto* t = targets.const_data_ptr<int64_t>();
    auto* lse_out = lse.data_ptr<float>();
    auto* loss_out = loss.data_ptr<float>();
    at::parallel_for(0, N, grain(C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const T* row = x + i * C;
        const float max =
            at::vec::reduce_all<T>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, row, C);
        const float sum =
            at::vec::map_reduce_all<T>([max](Vec v) { return (v - Vec(max)).exp_u20(); },
                                       [](Vec a, Vec b) { return a + b; }, row, C);
        lse_out[i] = max + std::log(sum);
        loss_out[i] = t[i] == ignore_index ? 0.0f : lse_out[i] - static_cast<float>(row[t[i]]);
      }
    });
  });
}

void cross_entropy_backward(const at::Tensor& logits, const at::Tensor& targets,
                            int64_t ignore_index, const at::Tensor& lse, float scale,
                            const at::Tensor& grad) {
  const int64_t N = logits.size(0), C = logits.size(1);
  mixprec::kernels::dispatch_float_types(logits.scalar_type(), "cross_entropy", [&](auto zero) {
    using T = decltype(zero);
    const auto* x = logits.const_data_ptr<T>();
    const auto* t = targets.const_data_ptr<int64_t>();
    const auto* lse_in = lse.const_data_ptr<float>();
    auto* g = grad.data_ptr<T>();
    at::parallel_for(0, N, grain(C), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        T* out = g + i * C;
        if (t[i] == ignore_index) {
          std::fill(out, out + C, T(0));
          continue;
        }
        const T* row = x + i * C;
        const float l = lse_in[i];
        at::vec::map<T>([l, scale](Vec v) { return (v - Vec(l)).exp_u20() * Vec(scale); }, out, row,
                        C);
        // The target's entry again, minus one before the single rounding.
        out[t[i]] = static_cast<T>((std::exp(static_cast<float>(row[t[i]]) - l) - 1.0f) * scale);
      }
    });
  });
}

}  // namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA
