#include "mixprec/amp/autocast.h"

#include "mixprec/amp/fp16_cpu.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include <ATen/Context.h>

namespace mixprec::amp {

namespace {

// Returns device_type, so that it can run first in the constructor's
// initializer list, before anything reads the device's autocast state.
c10::DeviceType checked_device(c10::DeviceType device_type) {
  TORCH_CHECK(at::autocast::is_autocast_available(device_type),
              "mixprec::amp::Autocast: User specified an unsupported autocast device_type '",
              c10::DeviceTypeName(device_type, /*lower_case=*/true), "'");
  return device_type;
}

void check_dtype(c10::DeviceType device_type, c10::ScalarType dtype) {
  TORCH_CHECK(dtype == c10::kBFloat16 || dtype == c10::kHalf, "mixprec::amp::Autocast: dtype ",
              dtype, " is not supported on ", c10::DeviceTypeName(device_type, true),
              "; expected BFloat16 or Half");
  if (device_type == c10::DeviceType::CUDA) {
    TORCH_CHECK(at::hasCUDA(),
                "mixprec::amp::Autocast: CUDA autocast asked for, but CUDA is not available");
  }
}

}  // namespace

Autocast::Autocast(c10::DeviceType device_type, std::optional<c10::ScalarType> dtype, bool enabled,
                   std::optional<bool> cache_enabled)
    : device_type_(checked_device(device_type)),
      dtype_(dtype.value_or(at::autocast::get_autocast_dtype(device_type))),
      enabled_(enabled),
      prev_enabled_(at::autocast::is_autocast_enabled(device_type)),
      prev_dtype_(at::autocast::get_autocast_dtype(device_type)),
      prev_cache_enabled_(at::autocast::is_autocast_cache_enabled()) {
  if (enabled_) check_dtype(device_type_, dtype_);
  if (enabled_ && device_type_ == c10::DeviceType::CPU && dtype_ == c10::kHalf)
    maybe_install_fp16_cpu_fast_path();
  at::autocast::set_autocast_enabled(device_type_, enabled_);
  at::autocast::set_autocast_dtype(device_type_, dtype_);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled.value_or(prev_cache_enabled_));
}

Autocast::~Autocast() {
  // Drop the cache when leaving the outermost autocast region.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_type_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

}  // namespace mixprec::amp
