// The softmax between the two GEMMs of models/attention.cpp's matmul attention,
// forward and backward, one pass over each row (held in L1): scale, causal mask,
// softmax and the rounding to the probabilities' dtype in one kernel, where
// LibTorch's ops would make four passes and a mask; for bf16, also the GEMM
// before it (oneDNN's brgemm, by blocks of rows). Built once per instruction
// set (CMakeLists.txt).
#include "models/kernels/attention_softmax.h"
#include "kernels/dispatch.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;

int64_t grain(int64_t Lk) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(Lk, 1)); }

int64_t kept(int64_t r, int64_t Lq, int64_t Lk, bool causal) {
  return causal ? std::min(r % Lq + 1, Lk) : Lk;
}

// n values of a reduced-precision row as fp32.
template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  using VecT = at::vec::Vectorized<T>;
  int64_t j = 0;
  for (; j + VecT::size() <= n; j += VecT::size()) {
    auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(src + j));
    lo.store(dst + j);
    hi.store(dst + j + Vec::size());
  }
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// One row of the forward: probabilities of its n kept scores (overwritten) into out[0, Lk).
template <typename T>
void softmax_row(float* row, int64_t n, int64_t Lk, float scale, T* out) {
  const float max =
      at::vec::reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, row, n);
  // exp(scale * (s - max)): scale > 0, so the largest exponent is 0.
  at::vec::map<float>([max, scale](Vec v) { return ((v - Vec(max)) * Vec(scale)).exp_u20(); }, row,
                      row, n);
  const float inv = 1.0f / at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, row, n);
  at::vec::map<float>([inv](Vec v) { return v * Vec(inv); }, row, row, n);
  if (static_cast<void*>(out) != static_cast<void*>(row)) at::vec::convert(row, out, n);
  std::fill(out + n, out + Lk, T(0));
}

// One row of the backward: grad_scores into out[0, Lk) from the n kept probabilities and
// gradients (drow, overwritten); buffer holds n floats unless T is float.
template <typename T>
void softmax_backward_row(const T* probs, float* drow, int64_t n, int64_t Lk, float scale,
                          float* buffer, T* out) {
  const float* prow;
  if constexpr (std::is_same_v<T, float>) {
    prow = probs;
  } else {
    to_float(probs, buffer, n);
    prow = buffer;
  }
  const float d = at::vec::map2_reduce_all<float>(
      [](Vec a, Vec b) { return a * b; }, [](Vec a, Vec b) { return a + b; }, prow, drow, n);
  at::vec::map2<float>([d, scale](Vec pv, Vec g) { return pv * (g - Vec(d)) * Vec(scale); }, drow,
                       prow, drow, n);
  if (static_cast<void*>(out) != static_cast<void*>(drow)) at::vec::convert(drow, out, n);
  std::fill(out + n, out + Lk, T(0));
}

// Rows of queries per brgemm call: its C block (32 x Lk fp32) stays in L1/L2, and a causal
// block computes up to its last row's column only.
constexpr int64_t kRows = 32;

// b (L, D) bf16 as oneDNN's VNNI-2 layout of its transpose, (D/2, L, 2): what brgemm takes for
// B = bᵀ. Pairs along D move together, as 32-bit words.
void pack_transposed(const at::BFloat16* b, int64_t L, int64_t D, at::BFloat16* out) {
  const auto* src = reinterpret_cast<const uint32_t*>(b);
  auto* dst = reinterpret_cast<uint32_t*>(out);
  const int64_t pairs = D / 2;
  for (int64_t t = 0; t < L; ++t)
    for (int64_t i = 0; i < pairs; ++i) dst[i * L + t] = src[t * pairs + i];
}

// For each (Lq, D) matrix a of `as` and (Lk, D) matrix b of `bs` (same leading dims): the fp32
// products a bᵀ by 32-row blocks, only the columns a causal block keeps, each block passed to
// row(r, fp32 row of Lk, kept columns, Lk floats of scratch) as it is made.
template <typename Row>
void bf16_products_by_rows(const at::Tensor& as, const at::Tensor& bs, bool causal, Row row) {
  const int64_t Lq = as.size(-2), D = as.size(-1), Lk = bs.size(-2);
  const int64_t matrices = as.numel() / (Lq * D);
  const auto* a = as.const_data_ptr<at::BFloat16>();
  const auto* b = bs.const_data_ptr<at::BFloat16>();
  at::parallel_for(0, matrices, 1, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> packed(Lk * D);
    std::vector<float> block((kRows + 1) * Lk);  // the block and a row of scratch
    float* scratch = block.data() + kRows * Lk;
    for (int64_t h = begin; h < end; ++h) {
      pack_transposed(b + h * Lk * D, Lk, D, packed.data());
      for (int64_t m = 0; m < Lq; m += kRows) {
        const int64_t rows = std::min(kRows, Lq - m), cols = kept(m + rows - 1, Lq, Lk, causal);
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
        at::native::cpublas::brgemm(rows, cols, D, /*ld_a=*/D, /*ld_b=*/Lk, /*ld_c=*/Lk,
                                    /*add_C=*/false, a + (h * Lq + m) * D, packed.data(),
                                    block.data(), /*is_vnni=*/true);
#else
        TORCH_CHECK(false, "attention: this LibTorch has no bf16 brgemm");
#endif
        for (int64_t i = 0; i < rows; ++i)
          row(h * Lq + m + i, block.data() + i * Lk, kept(m + i, Lq, Lk, causal), scratch);
      }
    }
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
#endif
  });
}

}  // namespace

void attention_bf16_forward(const at::Tensor& q, const at::Tensor& k, bool causal, float scale,
                            const at::Tensor& probs) {
  const int64_t Lk = k.size(-2);
  auto* p = probs.data_ptr<at::BFloat16>();
  bf16_products_by_rows(q, k, causal, [&](int64_t r, float* scores, int64_t n, float*) {
    softmax_row(scores, n, Lk, scale, p + r * Lk);
  });
}

void attention_bf16_backward(const at::Tensor& probs, const at::Tensor& grad, const at::Tensor& v,
                             bool causal, float scale, const at::Tensor& grad_scores) {
  const int64_t Lk = v.size(-2);
  const auto* p = probs.const_data_ptr<at::BFloat16>();
  auto* ds = grad_scores.data_ptr<at::BFloat16>();
  bf16_products_by_rows(grad, v, causal, [&](int64_t r, float* grad_probs, int64_t n, float* buf) {
    softmax_backward_row(p + r * Lk, grad_probs, n, Lk, scale, buf, ds + r * Lk);
  });
}

void attention_softmax_forward(const at::Tensor& scores, int64_t Lq, bool causal, float scale,
                               const at::Tensor& probs) {
  const int64_t Lk = scores.size(-1), R = scores.numel() / Lk;
  float* s = scores.data_ptr<float>();
  mixprec::kernels::dispatch_float_types(probs.scalar_type(), "attention softmax", [&](auto zero) {
    using T = decltype(zero);
    T* p = probs.data_ptr<T>();
    at::parallel_for(0, R, grain(Lk), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        softmax_row(s + r * Lk, kept(r, Lq, Lk, causal), Lk, scale, p + r * Lk);
    });
  });
}

void attention_softmax_backward(const at::Tensor& probs, const at::Tensor& grad_probs, int64_t Lq,
                                bool causal, float scale, const at::Tensor& grad_scores) {
  const int64_t Lk = probs.size(-1), R = probs.numel() / Lk;
  float* dp = grad_probs.data_ptr<float>();
  mixprec::kernels::dispatch_float_types(probs.scalar_type(), "attention softmax", [&](auto zero) {
    using T = decltype(zero);
    const T* p = probs.const_data_ptr<T>();
    T* ds = grad_scores.data_ptr<T>();
    at::parallel_for(0, R, grain(Lk), [&](int64_t begin, int64_t end) {
      std::vector<float> buffer(std::is_same_v<T, float> ? 0 : Lk);
      for (int64_t r = begin; r < end; ++r)
        softmax_backward_row(p + r * Lk, dp + r * Lk, kept(r, Lq, Lk, causal), Lk, scale,
                             buffer.data(), ds + r * Lk);
    });
  });
}

}  // namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA
