#include "mixprec/amp/custom_function.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace mixprec::amp::detail {

namespace {
constexpr const char* kUsedAutocast = "mixprec::amp::custom_fwd used autocast";
constexpr const char* kAutocastDtype = "mixprec::amp::custom_fwd autocast dtype";
}  // namespace

at::Tensor cast_tensor(const at::Tensor& value, c10::DeviceType device_type,
                       c10::ScalarType dtype) {
  const bool eligible = value.defined() && value.is_floating_point() &&
                        value.device().type() == device_type && value.scalar_type() != at::kDouble;
  return eligible ? value.to(dtype) : value;
}

bool save_forward_autocast(torch::autograd::AutogradContext* ctx, c10::DeviceType device_type,
                           bool cast_inputs) {
  const bool autocast_on = at::autocast::is_autocast_enabled(device_type);
  ctx->saved_data[kUsedAutocast] = autocast_on && !cast_inputs;
  ctx->saved_data[kAutocastDtype] = at::autocast::get_autocast_dtype(device_type);
  return autocast_on;
}

ForwardAutocast forward_autocast(const torch::autograd::AutogradContext* ctx) {
  const auto used = ctx->saved_data.find(kUsedAutocast);
  const auto dtype = ctx->saved_data.find(kAutocastDtype);
  TORCH_CHECK(used != ctx->saved_data.end() && dtype != ctx->saved_data.end(),
              "mixprec::amp::custom_bwd: the forward did not run through amp::custom_fwd, so "
              "its autocast state is unknown");
  return {used->second.toBool(), dtype->second.toScalarType()};
}

}  // namespace mixprec::amp::detail
