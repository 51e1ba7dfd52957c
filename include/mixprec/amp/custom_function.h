#pragma once

#include "mixprec/amp/autocast.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <concepts>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixprec::amp {

namespace detail {

// torch.amp's _cast: a floating tensor on `device_type`, float64 aside, to `dtype`; anything
// else as it is.
at::Tensor cast_input(const at::Tensor& value, c10::DeviceType device_type, c10::ScalarType dtype);
std::vector<at::Tensor> cast_input(const std::vector<at::Tensor>& values,
                                   c10::DeviceType device_type, c10::ScalarType dtype);
template <typename T>
requires(!std::convertible_to<const T&, const at::Tensor&> &&
         !std::same_as<std::decay_t<T>, std::vector<at::Tensor>>) T &&
    cast_input(T&& value, c10::DeviceType, c10::ScalarType) {
  return std::forward<T>(value);
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
/// (floating tensors on `device_type`, float64 aside, and those of a `std::vector<at::Tensor>`,
/// to `cast_inputs`; the rest as they are), and the backward will run without autocast too.
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
decltype(auto) custom_fwd(torch::autograd::AutogradContext* ctx, c10::DeviceType device_type,
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
decltype(auto) custom_bwd(const torch::autograd::AutogradContext* ctx, c10::DeviceType device_type,
                          F&& backward) {
  const auto state = detail::forward_autocast(ctx);
  Autocast guard(device_type, state.dtype, state.enabled);
  return std::invoke(std::forward<F>(backward));
}

}  // namespace mixprec::amp
