// The softmax between the two GEMMs of models/attention.cpp's matmul attention,
// forward and backward, a few passes over each row while it is in L1: scale,
// causal mask, softmax and the rounding to the probabilities' dtype in one
// kernel, where LibTorch's ops would make four passes over memory and a mask;
// the masked tails of the rows in vector code too; for bf16, the GEMMs around
// it as well (oneDNN's brgemm, by blocks of rows, causal: the kept blocks
// only). Built once per instruction set (CMakeLists.txt).
#include "models/kernels/attention_softmax.h"
#include "kernels/dispatch.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;

int64_t grain(int64_t Lk) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(Lk, 1)); }

int64_t kept(int64_t r, int64_t Lq, int64_t Lk, bool causal) {
  return causal ? std::min(r % Lq + 1, Lk) : Lk;
}

// Loads count (<= one vector of T) values as fp32 vectors, zeros past count: one vector for
// float, two for 16 bits. (Older LibTorch's AVX2 16-bit loadu leaves the lanes past count
// undefined, and 0 * inf there would make a row's sum NaN: they are zeroed here.)
template <typename T>
C10_ALWAYS_INLINE auto load(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, count);
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, count));
    constexpr int64_t V = Vec::size();
    if (count < 2 * V) {
      lo = Vec::set(Vec(0.0f), lo, std::min(count, V));
      hi = Vec::set(Vec(0.0f), hi, std::max<int64_t>(count - V, 0));
    }
    return std::make_tuple(lo, hi);
  }
}

// count (<= one vector of T) fp32 values, as load<T>() gives T's.
template <typename T>
C10_ALWAYS_INLINE auto load_fp32(const float* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, count);
  } else {
    constexpr int64_t V = Vec::size();
    return std::make_tuple(Vec::loadu(p, std::min(count, V)),
                           Vec::loadu(p + V, std::max<int64_t>(count - V, 0)));
  }
}

// f on what load() gives: f(x...) for float, on each half for 16 bits.
template <typename F, typename... X>
auto lanes(F f, const X&... x) {
  if constexpr ((std::is_same_v<X, Vec> && ...))
    return f(x...);
  else
    return std::make_tuple(f(std::get<0>(x)...), f(std::get<1>(x)...));
}
Vec total(Vec v) { return v; }
Vec total(const std::tuple<Vec, Vec>& v) { return std::get<0>(v) + std::get<1>(v); }

// Stores the first count (<= one vector of T) values of what load() gives, as T, rounded once.
void store(float* p, Vec v, int64_t count) { v.store(p, count); }
template <typename T>
C10_ALWAYS_INLINE void store(T* p, const std::tuple<Vec, Vec>& v, int64_t count) {
  at::vec::convert_from_float<T>(std::get<0>(v), std::get<1>(v)).store(p, count);
}

// f(j, count) for each vector of T over n values: j = 0, step, 2 step, ...; count = how many
// of its values are in the n (the last may have fewer).
template <typename T, typename F>
void for_each_vector(int64_t n, F f) {
  constexpr int64_t step = at::vec::Vectorized<T>::size();
  for (int64_t j = 0; j < n; j += step) f(j, std::min(step, n - j));
}

// One row of the forward: probabilities of its n kept scores (overwritten) into out[0, Lk).
// Three passes over the row in L1 (max; exp and sum; scale and rounding), tails masked. The
// first two mask only the tail vector: masking each vector, as for_each_vector's callers do,
// was ~10% slower there.
template <typename T>
void softmax_row(float* row, int64_t n, int64_t Lk, float scale, T* out) {
  constexpr int64_t V = Vec::size();
  const int64_t full = n - n % V, tail = n - full;
  const Vec lowest(-std::numeric_limits<float>::infinity());
  const auto max_of = [](Vec a, Vec b) { return at::vec::maximum(a, b); };
  Vec max_v = lowest;
  for (int64_t j = 0; j < full; j += V) max_v = max_of(max_v, Vec::loadu(row + j));
  if (tail > 0) max_v = max_of(max_v, Vec::set(lowest, Vec::loadu(row + full, tail), tail));
  const Vec max(at::vec::vec_reduce_all<float>(max_of, max_v));
  // exp(scale * (s - max)): scale > 0, so the largest exponent is 0.
  const auto scaled_exp = [&](Vec s) { return ((s - max) * Vec(scale)).exp_u20(); };
  Vec sum_v(0.0f);
  for (int64_t j = 0; j < full; j += V) {
    const Vec e = scaled_exp(Vec::loadu(row + j));
    e.store(row + j);
    sum_v = sum_v + e;
  }
  if (tail > 0) {
    const Vec e = Vec::set(Vec(0.0f), scaled_exp(Vec::loadu(row + full, tail)), tail);
    e.store(row + full, tail);
    sum_v = sum_v + e;
  }
  const float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, sum_v);
  const Vec inv(1.0f / sum);
  for_each_vector<T>(n, [&](int64_t j, int64_t c) {
    store(out + j, lanes([&](Vec e) { return e * inv; }, load_fp32<T>(row + j, c)), c);
  });
  std::memset(out + n, 0, (Lk - n) * sizeof(T));  // +0 in every dtype
}

// One row of the backward: grad_scores into out[0, Lk) from the n kept probabilities and
// gradients drow: scale p (g - sum(p g)), in two passes, the probabilities up-cast on the fly.
template <typename T>
void softmax_backward_row(const T* probs, const float* drow, int64_t n, int64_t Lk, float scale,
                          T* out) {
  Vec dot_v(0.0f);
  for_each_vector<T>(n, [&](int64_t j, int64_t c) {
    dot_v =
        dot_v + total(lanes(std::multiplies<>(), load(probs + j, c), load_fp32<T>(drow + j, c)));
  });
  const Vec d(at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, dot_v));
  const auto grad_score = [&](Vec p, Vec g) { return p * (g - d) * Vec(scale); };
  for_each_vector<T>(n, [&](int64_t j, int64_t c) {
    store(out + j, lanes(grad_score, load(probs + j, c), load_fp32<T>(drow + j, c)), c);
  });
  std::memset(out + n, 0, (Lk - n) * sizeof(T));
}

// Rows (queries, or keys in the transposed products) per brgemm call: its C block (32 x Lk
// fp32) stays in L1/L2, and a causal block computes up to its last row's column only.
constexpr int64_t kRows = 32;

int64_t round_up_even(int64_t n) { return n + n % 2; }

// C (M x N fp32, ld_c) = A (M x K bf16, ld_a) B, B in oneDNN's VNNI-2 layout (K/2, ld_b, 2).
// K even.
void product(int64_t M, int64_t N, int64_t K, const at::BFloat16* a, int64_t ld_a,
             const at::BFloat16* b, int64_t ld_b, float* c, int64_t ld_c) {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  at::native::cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, /*add_C=*/false, a, b, c,
                              /*is_vnni=*/true);
#else
  TORCH_CHECK(false, "attention: this LibTorch has no bf16 brgemm");
#endif
}

// b (L, D) bf16, rows ld_b apart, as oneDNN's VNNI-2 layout of its transpose, (D/2, L, 2): what
// brgemm takes for B = bᵀ. Pairs along D move together, as 32-bit words.
void pack_transposed(const at::BFloat16* b, int64_t ld_b, int64_t L, int64_t D, at::BFloat16* out) {
  auto* dst = reinterpret_cast<uint32_t*>(out);
  const int64_t pairs = D / 2;
  for (int64_t t = 0; t < L; ++t)
    for (int64_t i = 0; i < pairs; ++i)
      std::memcpy(dst + i * L + t, b + t * ld_b + 2 * i, sizeof(uint32_t));  // any alignment
}

// b (L, N) bf16, rows ld_b apart, as oneDNN's VNNI-2 layout, (L/2, N, 2) (a zero row after an odd
// L): what brgemm takes for B = b. Rows t and t + 1 interleave into 32-bit words.
void pack(const at::BFloat16* b, int64_t ld_b, int64_t L, int64_t N, at::BFloat16* out) {
  const auto* src = reinterpret_cast<const uint16_t*>(b);
  auto* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t t = 0; t < L; t += 2) {
    const uint16_t* lo = src + t * ld_b;
    uint32_t* row = dst + t / 2 * N;
    if (t + 1 < L) {
      const uint16_t* hi = lo + ld_b;
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) row[n] = lo[n] | uint32_t{hi[n]} << 16;
    } else {
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) row[n] = lo[n];
    }
  }
}

// rows x N fp32 (ld N) rounded once into bf16 rows, ld_out apart.
void round_rows(const float* c, int64_t rows, int64_t N, at::BFloat16* out, int64_t ld_out) {
  for (int64_t i = 0; i < rows; ++i)
    for_each_vector<at::BFloat16>(N, [&](int64_t j, int64_t count) {
      store(out + i * ld_out + j, load_fp32<at::BFloat16>(c + i * N + j, count), count);
    });
}

// Where the matrices (..., rows, cols) of t start, in elements from its data pointer, in order
// over the leading dims (their strides any).
std::vector<int64_t> matrix_offsets(const at::Tensor& t) {
  const int64_t lead = t.dim() - 2;
  std::vector<int64_t> index(lead, 0), offsets;
  const int64_t count = t.numel() / (t.size(-2) * t.size(-1));
  offsets.reserve(count);
  for (int64_t n = 0; n < count; ++n) {
    int64_t offset = 0;
    for (int64_t d = 0; d < lead; ++d) offset += index[d] * t.stride(d);
    offsets.push_back(offset);
    for (int64_t d = lead - 1; d >= 0 && ++index[d] == t.size(d); --d) index[d] = 0;
  }
  return offsets;
}

// A bf16 tensor's matrices (..., rows, cols), each row contiguous: the n-th at at(n), rows ld
// apart.
template <typename T>
struct Matrices {
  T* data;
  int64_t ld;
  std::vector<int64_t> offsets;
  explicit Matrices(const at::Tensor& t) : ld(t.stride(-2)), offsets(matrix_offsets(t)) {
    TORCH_INTERNAL_ASSERT(t.stride(-1) == 1, "attention: a bf16 operand's rows must be dense");
    if constexpr (std::is_const_v<T>) {
      data = t.const_data_ptr<at::BFloat16>();
    } else {
      data = t.data_ptr<at::BFloat16>();
    }
  }
  T* at(int64_t n) const { return data + offsets[n]; }
};
using In = Matrices<const at::BFloat16>;
using Out = Matrices<at::BFloat16>;

// One tile, M, N <= 32: ATen's vectorized transpose where this LibTorch has one of a runtime
// size (its AVX-512 build; a loop in its AVX2 one), else a loop.
template <typename T>
void transpose_tile(const T* src, int64_t ld_src, T* dst, int64_t ld_dst, int M, int N) {
  if constexpr (requires { at::vec::transpose_mxn<T>(src, ld_src, dst, ld_dst, M, N); }) {
    at::vec::transpose_mxn<T>(src, ld_src, dst, ld_dst, M, N);
  } else {
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) dst[j * ld_dst + i] = src[i * ld_src + j];
  }
}

// dst[j, r] = src[r, j] for rows [r0, R) and columns [j0, j1), by 32 x 32 tiles.
void transpose(const at::BFloat16* src, int64_t ld_src, int64_t r0, int64_t R, int64_t j0,
               int64_t j1, at::BFloat16* dst, int64_t ld_dst) {
  for (int64_t rt = r0; rt < R; rt += 32)
    for (int64_t jt = j0; jt < j1; jt += 32)
      transpose_tile(src + rt * ld_src + jt, ld_src, dst + jt * ld_dst + rt, ld_dst,
                     static_cast<int>(std::min<int64_t>(32, R - rt)),
                     static_cast<int>(std::min<int64_t>(32, j1 - jt)));
}

void release_brgemm() {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  at::native::cpublas::brgemm_release(/*is_vnni=*/true);
#endif
}

// Releases this thread's brgemm context (AMX tiles) as a chunk of work starts, so that its first
// call configures the tiles even where other code on the thread left a context behind, and as
// the chunk ends, also when it throws.
struct BrgemmContext {
  BrgemmContext() { release_brgemm(); }
  ~BrgemmContext() { release_brgemm(); }
  BrgemmContext(const BrgemmContext&) = delete;
  BrgemmContext& operator=(const BrgemmContext&) = delete;
};

}  // namespace

// Per (Lq, D) matrix: by 32-row blocks, the scores q kᵀ (fp32, the kept columns), their softmax
// into probs, and the block's output probs v (its kept columns: the rest are 0).
void attention_bf16_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, float scale, const at::Tensor& probs,
                            const at::Tensor& out) {
  const int64_t Lq = q.size(-2), D = q.size(-1), Lk = k.size(-2), Dv = v.size(-1);
  const In qs(q), ks(k), vs(v);
  const Out os(out);
  auto* ps = probs.data_ptr<at::BFloat16>();
  at::parallel_for(0, q.numel() / (Lq * D), 1, [&](int64_t begin, int64_t end) {
    const BrgemmContext context;
    std::vector<at::BFloat16> k_packed(Lk * D), v_packed(Lk * Dv);
    std::vector<float> block(kRows * std::max(Lk, Dv));
    for (int64_t h = begin; h < end; ++h) {
      pack_transposed(ks.at(h), ks.ld, Lk, D, k_packed.data());
      pack(vs.at(h), vs.ld, Lk, Dv, v_packed.data());
      for (int64_t m = 0; m < Lq; m += kRows) {
        const int64_t rows = std::min(kRows, Lq - m), cols = kept(m + rows - 1, Lq, Lk, causal);
        auto* p = ps + (h * Lq + m) * Lk;
        product(rows, cols, D, qs.at(h) + m * qs.ld, qs.ld, k_packed.data(), Lk, block.data(), Lk);
        for (int64_t i = 0; i < rows; ++i)
          softmax_row(block.data() + i * Lk, kept(m + i, Lq, Lk, causal), Lk, scale, p + i * Lk);
        // Lk is even, so the column past an odd cols is a masked 0 of every row here.
        product(rows, Dv, round_up_even(cols), p, Lk, v_packed.data(), Dv, block.data(), Dv);
        round_rows(block.data(), rows, Dv, os.at(h) + m * os.ld, os.ld);
      }
    }
  });
}

// Per matrix: the gradient of the scores ds by 32-row blocks (from grad vᵀ, the kept columns),
// each block's grad_q = ds k at once; then grad_k = dsᵀ q and grad_v = probsᵀ grad by 32-key
// blocks, from transposed copies of ds and probs, causal: only the queries that see the block.
void attention_bf16_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& probs, const at::Tensor& grad, bool causal,
                             float scale, const at::Tensor& grad_q, const at::Tensor& grad_k,
                             const at::Tensor& grad_v) {
  const int64_t Lq = q.size(-2), D = q.size(-1), Lk = k.size(-2), Dv = v.size(-1);
  const int64_t Lq2 = round_up_even(Lq);  // the transposes' rows: VNNI pairs of queries
  const In qs(q), ks(k), vs(v), gs(grad);
  const Out gq(grad_q), gk(grad_k), gv(grad_v);
  const auto* ps = probs.const_data_ptr<at::BFloat16>();
  at::parallel_for(0, q.numel() / (Lq * D), 1, [&](int64_t begin, int64_t end) {
    const BrgemmContext context;
    // (For an odd Lq, the transposes' column Lq is never written: it stays 0, and the packs'
    // last row is 0 too.)
    std::vector<at::BFloat16> v_packed(Lk * Dv), k_packed(Lk * D), q_packed(Lq2 * D),
        g_packed(Lq2 * Dv), ds(Lq * Lk), transposed(Lk * Lq2);
    std::vector<float> block(kRows * std::max({Lk, D, Dv}));
    // out (keys x N, bf16, rows ld_out apart) = srcᵀ b for the keys [n, n + keys) of src
    // (Lq x Lk), b packed.
    const auto transposed_product = [&](const at::BFloat16* src, const at::BFloat16* b_packed,
                                        int64_t N, int64_t n, int64_t keys, at::BFloat16* out,
                                        int64_t ld_out) {
      // Causal (top-left): query r sees key j when j <= r, so the keys from n on are seen by
      // the queries from n on only (none when n >= Lq: their gradients are 0).
      const int64_t first = causal ? std::min(n, Lq2) : 0, K = Lq2 - first;
      if (K == 0) {
        for (int64_t i = 0; i < keys; ++i) std::fill_n(out + i * ld_out, N, at::BFloat16(0));
        return;
      }
      auto* t = transposed.data();
      transpose(src, Lk, first, Lq, n, n + keys, t, Lq2);
      product(keys, N, K, t + n * Lq2 + first, Lq2, b_packed + first * N, N, block.data(), N);
      round_rows(block.data(), keys, N, out, ld_out);
    };
    for (int64_t h = begin; h < end; ++h) {
      const auto* p = ps + h * Lq * Lk;
      const auto* g = gs.at(h);
      pack_transposed(vs.at(h), vs.ld, Lk, Dv, v_packed.data());
      pack(ks.at(h), ks.ld, Lk, D, k_packed.data());
      for (int64_t m = 0; m < Lq; m += kRows) {
        const int64_t rows = std::min(kRows, Lq - m), cols = kept(m + rows - 1, Lq, Lk, causal);
        product(rows, cols, Dv, g + m * gs.ld, gs.ld, v_packed.data(), Lk, block.data(), Lk);
        for (int64_t i = 0; i < rows; ++i)
          softmax_backward_row(p + (m + i) * Lk, block.data() + i * Lk, kept(m + i, Lq, Lk, causal),
                               Lk, scale, ds.data() + (m + i) * Lk);
        product(rows, D, round_up_even(cols), ds.data() + m * Lk, Lk, k_packed.data(), D,
                block.data(), D);
        round_rows(block.data(), rows, D, gq.at(h) + m * gq.ld, gq.ld);
      }
      pack(qs.at(h), qs.ld, Lq, D, q_packed.data());
      pack(g, gs.ld, Lq, Dv, g_packed.data());
      for (int64_t n = 0; n < Lk; n += kRows) {
        const int64_t keys = std::min(kRows, Lk - n);
        transposed_product(ds.data(), q_packed.data(), D, n, keys, gk.at(h) + n * gk.ld, gk.ld);
        transposed_product(p, g_packed.data(), Dv, n, keys, gv.at(h) + n * gv.ld, gv.ld);
      }
    }
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
      for (int64_t r = begin; r < end; ++r)
        softmax_backward_row(p + r * Lk, dp + r * Lk, kept(r, Lq, Lk, causal), Lk, scale,
                             ds + r * Lk);
    });
  });
}

}  // namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA
