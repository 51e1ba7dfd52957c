#include "mixprec/optim/stochastic_rounding.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace mixprec::optim {

at::Tensor stochastic_round_to_bf16(const at::Tensor& x, std::optional<at::Generator> generator) {
  TORCH_CHECK(x.scalar_type() == at::kFloat,
              "stochastic_round_to_bf16: expected a float32 tensor, got ", x.scalar_type());
  const auto bits = x.contiguous().view(at::kInt);
  const auto noise = at::randint(0, 1 << 16, x.sizes(), generator, bits.options());
  // Sign-magnitude: adding to the magnitude bits rounds |x| up with the right
  // probability, for either sign. A carry into the exponent is the next binade.
  const auto rounded = at::bitwise_and(bits + noise, static_cast<int32_t>(0xFFFF0000));
  auto result = rounded.view(at::kFloat).to(at::kBFloat16);
  return at::where(x.isfinite(), result, x.to(at::kBFloat16));  // inf stays inf, NaN stays NaN
}

}  // namespace mixprec::optim
