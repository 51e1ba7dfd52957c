#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace mixprec::amp {

/// RAII twin of `torch.autocast`: ops inside the scope run in `dtype` where
/// LibTorch's autocast policy says so (the same op lists as PyTorch's: matmuls
/// and convolutions in 16 bits; losses and a few ops such as `prod` in fp32; on
/// CPU, softmax, layer_norm and sums keep their input's dtype, on CUDA they run
/// in fp32).
///
/// ```
/// {
///   mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
///   auto loss = torch::mse_loss(model->forward(x), y);  // linear in bf16, loss in fp32
/// }
/// ```
///
/// Same semantics as `torch.autocast.__enter__/__exit__`: the previous enabled
/// flag, dtype and cache flag are saved and restored; guards nest, and the
/// outermost one clears the cast cache on exit; `enabled = false` inside an
/// enabled region turns autocast off for its scope. Unlike PyTorch, a dtype
/// that autocast does not support is an error, not a warning and a silent
/// disable.
class Autocast {
 public:
  /// `dtype` defaults to the device's current autocast dtype (bf16 on CPU, fp16
  /// on CUDA unless changed), `cache_enabled` to the current cache flag (true
  /// unless changed), as in PyTorch.
  explicit Autocast(c10::DeviceType device_type,
                    std::optional<c10::ScalarType> dtype = std::nullopt, bool enabled = true,
                    std::optional<bool> cache_enabled = std::nullopt);
  ~Autocast();

  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

  c10::DeviceType device_type() const { return device_type_; }
  c10::ScalarType dtype() const { return dtype_; }
  bool enabled() const { return enabled_; }

 private:
  c10::DeviceType device_type_;
  c10::ScalarType dtype_;
  bool enabled_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

}  // namespace mixprec::amp
