// GELU with the tanh approximation (GPT-2's gelu_new), forward and backward, on
// LibTorch's vector types and thread pool. Built once per instruction set
// (CMakeLists.txt: AVX2 and AVX-512, as ATen builds its own kernels);
// models/gelu.cpp picks one at run time.
#include "models/kernels/gelu_tanh.h"

#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;

// 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): GPT-2's formula,
// computed with one fast exp instead of tanh (~3x faster than LibTorch's kernel, which spends
// its time in tanh); in fp32 for every dtype (accuracy: models/gelu.h).
constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

Vec sigmoid_2u(Vec x, Vec x_sq) {
  const Vec u = Vec(kBeta) * (x + Vec(kKappa) * x_sq * x);
  return Vec(1.0f) / (Vec(1.0f) + (Vec(-2.0f) * u).exp_u20());
}

Vec forward(Vec x) { return x * sigmoid_2u(x, x * x); }

// d/dx x s(2u) = s + 2 x s (1 - s) u'.
Vec backward(Vec dy, Vec x) {
  const Vec x_sq = x * x;
  const Vec s = sigmoid_2u(x, x_sq);
  const Vec du = Vec(kBeta) * (Vec(1.0f) + Vec(3.0f * kKappa) * x_sq);
  return dy * (s + Vec(2.0f) * x * s * (Vec(1.0f) - s) * du);
}

// Loads count (<= one vector of T) elements as fp32 vectors: one for float, two for 16 bits.
template <typename T>
auto load(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>)
    return Vec::loadu(p, count);
  else
    return at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, count));
}

// out[i] = f(in[i]...) for n contiguous elements, in fp32, rounded once to T.
template <typename T, typename F, typename... In>
void map(F f, int64_t n, T* out, const In*... in) {
  constexpr int64_t step = at::vec::Vectorized<T>::size();
  for (int64_t i = 0; i < n; i += step) {
    const int64_t count = std::min(step, n - i);
    if constexpr (std::is_same_v<T, float>) {
      f(load(in + i, count)...).store(out + i, count);
    } else {
      const auto args = std::make_tuple(load(in + i, count)...);
      const auto lo = std::apply([&](const auto&... a) { return f(std::get<0>(a)...); }, args);
      const auto hi = std::apply([&](const auto&... a) { return f(std::get<1>(a)...); }, args);
      at::vec::convert_from_float<T>(lo, hi).store(out + i, count);
    }
  }
}

// Runs map over the (contiguous) tensors of iter, output first, on LibTorch's threads.
template <typename F>
void run(at::TensorIteratorBase& iter, F f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, iter.common_dtype(), "gelu_tanh", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "gelu_tanh: double runs LibTorch's kernel (models/gelu.cpp)");
    } else {
      const int n = iter.ntensors();
      iter.for_each([&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
        for (int k = 0; k < n; ++k)
          TORCH_INTERNAL_ASSERT(strides[k] == sizeof(scalar_t), "gelu_tanh: not contiguous");
        for (int64_t j = 0; j < size1; ++j) {
          auto row = [&](int k) {
            return reinterpret_cast<scalar_t*>(data[k] + j * strides[n + k]);
          };
          auto in = [&](int k) { return static_cast<const scalar_t*>(row(k)); };
          if constexpr (std::is_invocable_v<F, Vec>)
            map<scalar_t>(f, size0, row(0), in(1));
          else
            map<scalar_t>(f, size0, row(0), in(1), in(2));
        }
      });
    }
  });
}

}  // namespace

void gelu_tanh_forward(const at::Tensor& x, const at::Tensor& y) {
  auto iter = at::TensorIteratorConfig().add_output(y).add_input(x).build();
  run(iter, [](Vec v) { return forward(v); });
}

void gelu_tanh_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx) {
  auto iter = at::TensorIteratorConfig().add_output(dx).add_input(dy).add_input(x).build();
  run(iter, [](Vec g, Vec v) { return backward(g, v); });
}

}  // namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA
