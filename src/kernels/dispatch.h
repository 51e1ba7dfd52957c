// The dtype switch of the kernels in */kernels/.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::kernels {

// f(T{}) with T the C++ type of dtype: float, BFloat16 or Half.
template <typename F>
void dispatch_float_types(at::ScalarType dtype, const char* kernel, F f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(at::BFloat16{});
    case at::kHalf:
      return f(at::Half{});
    default:
      TORCH_CHECK(false, kernel, ": no kernel for ", dtype);
  }
}

}  // namespace mixprec::kernels
