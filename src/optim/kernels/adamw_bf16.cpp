// Pure-bf16 AdamW with stochastic rounding as one loop over the elements: the
// op-by-op version (fp32 copies, LibTorch's random_, masks, three roundings)
// made the optimizer 40% of a GPT-2 step. A counter-based hash gives the
// random bits, so the loop vectorizes and its result does not depend on how
// it is split among threads. Built once per instruction set (CMakeLists.txt).
#include "optim/kernels/adamw_bf16.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace mixprec::optim::kernels::MIXPREC_KERNEL_ISA {
namespace {

// MurmurHash3's 32-bit finalizer: every input bit flips each output bit with
// probability ~1/2.
inline uint32_t mix(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

inline float from_bf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x rounded to bf16 up or down with probability proportional to nearness
// (`noise`: 16 random bits below the bf16 mantissa, as
// stochastic_round_to_bf16); inf/NaN to nearest.
inline uint16_t to_bf16(float x, uint32_t noise) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
  // inf: exact in bf16; NaN: keep a mantissa bit that survives the truncation.
  const uint32_t rounded = finite ? bits + noise : bits | (x != x ? 0x00400000u : 0u);
  return static_cast<uint16_t>(rounded >> 16);
}

}  // namespace

void adamw_bf16_stochastic(const at::Tensor& param, const at::Tensor& grad,
                           const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                           const AdamWStep& s, uint64_t seed) {
  auto* p = reinterpret_cast<uint16_t*>(param.data_ptr<at::BFloat16>());
  const auto* g = reinterpret_cast<const uint16_t*>(grad.const_data_ptr<at::BFloat16>());
  auto* m = reinterpret_cast<uint16_t*>(exp_avg.data_ptr<at::BFloat16>());
  auto* v = reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr<at::BFloat16>());
  const uint32_t seed_lo = static_cast<uint32_t>(seed), seed_hi = static_cast<uint32_t>(seed >> 32);
  const float decay = 1.0f - s.lr * s.weight_decay, w1 = 1.0f - s.beta1, w2 = 1.0f - s.beta2;
  const float sign = s.maximize ? -1.0f : 1.0f;
  at::parallel_for(0, param.numel(), 16384, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const float grad_i = sign * from_bf16(g[i]);
      float param_i = from_bf16(p[i]) * decay;
      float m_i = from_bf16(m[i]);
      m_i += w1 * (grad_i - m_i);  // lerp(m, grad, 1 - beta1)
      const float v_i = from_bf16(v[i]) * s.beta2 + w2 * grad_i * grad_i;
      const float denom = std::sqrt(v_i) / s.bias_correction2_sqrt + s.eps;
      param_i -= s.step_size * (m_i / denom);
      const uint32_t index = static_cast<uint32_t>(i), high = static_cast<uint32_t>(i >> 32);
      const uint32_t r1 = mix(mix(2 * index ^ seed_lo) + seed_hi + high);
      const uint32_t r2 = mix(mix((2 * index + 1) ^ seed_lo) + seed_hi + high);
      p[i] = to_bf16(param_i, r1 & 0xffffu);
      m[i] = to_bf16(m_i, r1 >> 16);
      v[i] = to_bf16(v_i, r2 & 0xffffu);
    }
  });
}

}  // namespace mixprec::optim::kernels::MIXPREC_KERNEL_ISA
