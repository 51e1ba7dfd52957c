// The softmax between the two GEMMs of models/attention.cpp's matmul attention,
// forward and backward, one pass over each row (held in L1): scale, causal mask,
// softmax and the rounding to the probabilities' dtype in one kernel, where
// LibTorch's ops would make four passes and a mask. Built once per instruction
// set (CMakeLists.txt).
#include "models/kernels/attention_softmax.h"
#include "kernels/dispatch.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;

int64_t grain(int64_t Lk) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(Lk, 1)); }

int64_t kept(int64_t r, int64_t Lq, int64_t Lk, bool causal) {
  return causal ? std::min(r % Lq + 1, Lk) : Lk;
}

// n values of a reduced-precision row as fp32.
template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  using VecT = at::vec::Vectorized<T>;
  int64_t j = 0;
  for (; j + VecT::size() <= n; j += VecT::size()) {
    auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(src + j));
    lo.store(dst + j);
    hi.store(dst + j + Vec::size());
  }
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

}  // namespace

void attention_softmax_forward(const at::Tensor& scores, int64_t Lq, bool causal, float scale,
                               const at::Tensor& probs) {
  const int64_t Lk = scores.size(-1), R = scores.numel() / Lk;
  float* s = scores.data_ptr<float>();
  mixprec::kernels::dispatch_float_types(probs.scalar_type(), "attention softmax", [&](auto zero) {
    using T = decltype(zero);
    T* p = probs.data_ptr<T>();
    at::parallel_for(0, R, grain(Lk), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t n = kept(r, Lq, Lk, causal);
        float* row = s + r * Lk;
        T* out = p + r * Lk;
        const float max =
            at::vec::reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, row, n);
        // exp(scale * (s - max)): scale > 0, so the largest exponent is 0.
        at::vec::map<float>([max, scale](Vec v) { return ((v - Vec(max)) * Vec(scale)).exp_u20(); },
                            row, row, n);
        const float inv =
            1.0f / at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, row, n);
        at::vec::map<float>([inv](Vec v) { return v * Vec(inv); }, row, row, n);
        if (static_cast<void*>(out) != static_cast<void*>(row)) at::vec::convert(row, out, n);
        std::fill(out + n, out + Lk, T(0));
      }
    });
  });
}

void attention_softmax_backward(const at::Tensor& probs, const at::Tensor& grad_probs, int64_t Lq,
                                bool causal, float scale, const at::Tensor& grad_scores) {
  const int64_t Lk = probs.size(-1), R = probs.numel() / Lk;
  float* dp = grad_probs.data_ptr<float>();
  mixprec::kernels::dispatch_float_types(probs.scalar_type(), "attention softmax", [&](auto zero) {
    using T = decltype(zero);
    const T* p = probs.const_data_ptr<T>();
    T* ds = grad_scores.data_ptr<T>();
    at::parallel_for(0, R, grain(Lk), [&](int64_t begin, int64_t end) {
      std::vector<float> buffer(std::is_same_v<T, float> ? 0 : Lk);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t n = kept(r, Lq, Lk, causal);
        float* drow = dp + r * Lk;
        const float* prow;
        if constexpr (std::is_same_v<T, float>) {
          prow = p + r * Lk;
        } else {
          to_float(p + r * Lk, buffer.data(), n);
          prow = buffer.data();
        }
        const float d = at::vec::map2_reduce_all<float>(
            [](Vec a, Vec b) { return a * b; }, [](Vec a, Vec b) { return a + b; }, prow, drow, n);
        T* out = ds + r * Lk;
        at::vec::map2<float>([d, scale](Vec pv, Vec g) { return pv * (g - Vec(d)) * Vec(scale); },
                             drow, prow, drow, n);
        if (static_cast<void*>(out) != static_cast<void*>(drow)) at::vec::convert(drow, out, n);
        std::fill(out + n, out + Lk, T(0));
      }
    });
  });
}

}  // namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA
