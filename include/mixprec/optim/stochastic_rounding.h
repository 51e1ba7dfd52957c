#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <optional>

namespace mixprec::optim {

/// fp32 -> bf16 with stochastic rounding: each value rounds to one of its two
/// bf16 neighbours with a probability proportional to its nearness, so the
/// expectation equals the fp32 value. Pure-bf16 training (parameters kept in
/// bf16, no fp32 master copy) needs it: an update smaller than half a bf16 ulp
/// is lost by round-to-nearest every step, but survives on average here.
/// inf and NaN map to themselves; the largest values may round up to inf.
///
/// Works on the bit pattern: add 16 random bits below the bf16 mantissa, then
/// truncate them (exact in fp32, so the final cast to bf16 does not round).
at::Tensor stochastic_round_to_bf16(const at::Tensor& x,
                                    std::optional<at::Generator> generator = std::nullopt);

}  // namespace mixprec::optim
