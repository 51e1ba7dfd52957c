#pragma once

#include "mixprec/amp/autocast.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <functional>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec::amp {

namespace detail {

// torch.amp's _cast of one tensor: a floating tensor on `device_type`, float64 aside, to
// `dtype`; any other as it is.
at::Tensor cast_tensor(const at::Tensor& value, c10::DeviceType device_type, c10::ScalarType dtype);

// torch.amp's _cast of an argument: a tensor, an optional one, each of a list of tensors (as a
// vector); anything else passes through.
template <typename T>
decltype(auto) cast_input(T&& value, c10::DeviceType device_type, c10::ScalarType dtype) {
  using V = std::decay_t<T>;
  if constexpr (std::is_convertible_v<const V&, const at::Tensor&>) {
    return cast_tensor(value, device_type, dtype);
  } else if constexpr (std::is_same_v<V, std::optional<at::Tensor>>) {
    return value ? std::optional(cast_tensor(*value, device_type, dtype)) : std::nullopt;
  } else if constexpr (std::is_convertible_v<const V&, at::TensorList>) {
    std::vector<at::Tensor> cast;
    for (const auto& t : at::TensorList(value)) cast.push_back(cast_tensor(t, device_type, dtype));
    return cast;
  } else {
    return std::forward<T>(value);
  }
}

// Leaves in the context what custom_bwd needs: whether the forward runs under autocast (it
// does when autocast is on and the inputs are not cast), and autocast's dtype. Returns
// whether autocast is on.
bool save_forward_autocast(torch::autograd::AutogradContext* ctx, c10::DeviceType device_type,
                           bool cast_inputs);
struct ForwardAutocast {
  bool enabled;
  c10::ScalarType dtype;
};
ForwardAutocast forward_autocast(const torch::autograd::AutogradContext* ctx);

}  // namespace detail

/// `torch.amp.custom_fwd` for the forward of a C++ autograd `Function`: records the autocast
/// state for `custom_bwd`, then runs `forward(args...)`. With `cast_inputs` and autocast on,
/// `forward` runs with autocast off, on its arguments cast as torch's `_cast` casts them
/// (floating tensors on `device_type`, float64 aside, also in an `std::optional<at::Tensor>` or
/// a list of tensors, to `cast_inputs`; other arguments as they are), and the backward will run
/// without autocast too. A cast list arrives as a `std::vector<at::Tensor>`, an uncast one as
/// it was given: `forward` takes both as `at::TensorList`.
/// Without `cast_inputs`, `forward` runs under the caller's autocast state, and the backward
/// will run under the same.
///
/// ```
/// struct Fp32MatMul : torch::autograd::Function<Fp32MatMul> {
///   static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
///     return amp::custom_fwd(ctx, at::kCPU, at::kFloat, [&](const at::Tensor& a32,
///                                                          const at::Tensor& b32) {
///       ctx->save_for_backward({a32, b32});
///       return a32.mm(b32);
///     }, a, b);
///   }
///   static variable_list backward(AutogradContext* ctx, variable_list grads) {
///     return amp::custom_bwd(ctx, at::kCPU, [&] { ... });
///   }
/// };
/// ```
template <typename F, typename... Args>
auto custom_fwd(torch::autograd::AutogradContext* ctx, c10::DeviceType device_type,
                std::optional<c10::ScalarType> cast_inputs, F&& forward, Args&&... args) {
  const bool autocast_on = detail::save_forward_autocast(ctx, device_type, cast_inputs.has_value());
  if (!cast_inputs || !autocast_on)
    return std::invoke(std::forward<F>(forward), std::forward<Args>(args)...);
  Autocast off(device_type, std::nullopt, /*enabled=*/false);
  return std::invoke(std::forward<F>(forward),
                     detail::cast_input(std::forward<Args>(args), device_type, *cast_inputs)...);
}

/// `torch.amp.custom_bwd` for the backward of a `Function` whose forward ran through
/// `custom_fwd`: runs `backward()` under the autocast state the forward ran under (its
/// enabled flag and dtype), not the state of the thread that runs the backward. Without
/// `custom_fwd` in the forward, an error.
template <typename F>
auto custom_bwd(const torch::autograd::AutogradContext* ctx, c10::DeviceType device_type,
                F&& backward) {
  const auto state = detail::forward_autocast(ctx);
  Autocast guard(device_type, state.dtype, state.enabled);
  return std::invoke(std::forward<F>(backward));
}

}  // namespace mixprec::amp
