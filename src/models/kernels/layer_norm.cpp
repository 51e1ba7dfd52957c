// LayerNorm over the last dimension of an fp32 tensor, its output rounded
// once to the dtype of y, and its backward from a gradient of that dtype, up-cast
// on the fly: the casts autocast would make around it, fused into its passes.
// One row (C values) at a time while it is in L1. Built once per instruction set
// (CMakeLists.txt).
#include "models/kernels/layer_norm.h"
#include "kernels/dispatch.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// v with its lanes from count on zeroed (Vec::set's blend, only for a row's tail vector).
Vec head(Vec v, int64_t count) { return count < kLanes ? Vec::set(Vec(0.0f), v, count) : v; }

// count (<= kLanes) values of T as fp32, zeros past count (older LibTorch's AVX2 16-bit
// loadu leaves those lanes undefined).
template <typename T>
Vec load(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, count);
  } else {
    const Vec v =
        std::get<0>(at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, count)));
    return head(v, count);
  }
}

// The first count (<= kLanes) lanes of v, rounded to T.
template <typename T>
void store(Vec v, T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>)
    v.store(p, count);
  else
    at::vec::convert_from_float<T>(v, v).store(p, count);
}

// f(j, count) for each vector of a row of C values; count < kLanes at the tail only.
template <typename F>
void for_each_vector(int64_t C, F f) {
  for (int64_t j = 0; j < C; j += kLanes) f(j, std::min(kLanes, C - j));
}

float sum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v);
}

// Rows per task: ~16K values, as LibTorch's elementwise kernels.
int64_t grain(int64_t C) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1)); }

}  // namespace

void layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        double eps, const at::Tensor& y, const at::Tensor& mean,
                        const at::Tensor& rstd) {
  const int64_t C = x.size(-1), R = x.numel() / C;
  const float* xs = x.const_data_ptr<float>();
  const float* g = weight.const_data_ptr<float>();
  const float* b = bias.const_data_ptr<float>();
  float* means = mean.data_ptr<float>();
  float* rstds = rstd.data_ptr<float>();
  mixprec::kernels::dispatch_float_types(y.scalar_type(), "layer_norm", [&](auto zero) {
    using T = decltype(zero);
    T* ys = y.data_ptr<T>();
    at::parallel_for(0, R, grain(C), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* row = xs + r * C;
        // Two passes (the mean, then the squares about it): no cancellation, as fp64 would get.
        Vec s(0.0f);
        for_each_vector(C, [&](int64_t j, int64_t c) { s = s + Vec::loadu(row + j, c); });
        const float mu = sum(s) / static_cast<float>(C);
        Vec sq(0.0f);
        for_each_vector(C, [&](int64_t j, int64_t c) {
          const Vec d = head(Vec::loadu(row + j, c) - Vec(mu), c);
          sq = at::vec::fmadd(d, d, sq);
        });
        const float rs =
            1.0f / std::sqrt(sum(sq) / static_cast<float>(C) + static_cast<float>(eps));
        means[r] = mu;
        rstds[r] = rs;
        for_each_vector(C, [&](int64_t j, int64_t c) {
          const Vec xhat = (Vec::loadu(row + j, c) - Vec(mu)) * Vec(rs);
          store(at::vec::fmadd(xhat, Vec::loadu(g + j, c), Vec::loadu(b + j, c)), ys + r * C + j,
                c);
        });
      }
    });
  });
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy weight; dweight and dbias sum
// dy xhat and dy over the rows: each fixed chunk of rows into its own row of a buffer, then the
// chunks in order, so the sums do not depend on the thread count.
void layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                         const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& dx,
                         const at::Tensor& dweight, const at::Tensor& dbias) {
  const int64_t C = x.size(-1), R = x.numel() / C;
  const float* xs = x.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  const float* means = mean.const_data_ptr<float>();
  const float* rstds = rstd.const_data_ptr<float>();
  float* dxs = dx.data_ptr<float>();
  // At most 64 chunks, a number fixed apart from the threads: else the buffer, one (dweight,
  // dbias) per chunk of 16384 / C rows, would grow as R C^2 (twice x at C = 16384).
  const int64_t rows_per_chunk = std::max(grain(C), (R + 63) / 64);
  const int64_t chunks = (R + rows_per_chunk - 1) / rows_per_chunk;
  std::vector<float> partial(static_cast<size_t>(chunks) * 2 * C, 0.0f);  // (dweight, dbias)
  mixprec::kernels::dispatch_float_types(dy.scalar_type(), "layer_norm backward", [&](auto zero) {
    using T = decltype(zero);
    const T* dys = dy.const_data_ptr<T>();
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t chunk = first; chunk < last; ++chunk) {
        float* dw = partial.data() + static_cast<size_t>(chunk) * 2 * C;
        float* db = dw + C;
        const int64_t end = std::min(R, (chunk + 1) * rows_per_chunk);
        for (int64_t r = chunk * rows_per_chunk; r < end; ++r) {
          const float* row = xs + r * C;
          const T* drow = dys + r * C;
          const Vec mu(means[r]), rs(rstds[r]);
          // xhat is masked past the row: 0 * an overflowed (0 - mean) rstd would be NaN.
          const auto xhat_of = [&](int64_t j, int64_t c) {
            return head((Vec::loadu(row + j, c) - mu) * rs, c);
          };
          Vec sum_g(0.0f), sum_g_xhat(0.0f);
          for_each_vector(C, [&](int64_t j, int64_t c) {
            const Vec d = load(drow + j, c);
            const Vec xhat = xhat_of(j, c);
            const Vec gj = d * Vec::loadu(w + j, c);
            sum_g = sum_g + gj;
            sum_g_xhat = at::vec::fmadd(gj, xhat, sum_g_xhat);
            at::vec::fmadd(d, xhat, Vec::loadu(dw + j, c)).store(dw + j, c);
            (Vec::loadu(db + j, c) + d).store(db + j, c);
          });
          const Vec a(sum(sum_g) / static_cast<float>(C));
          const Vec b(sum(sum_g_xhat) / static_cast<float>(C));
          for_each_vector(C, [&](int64_t j, int64_t c) {
            const Vec gj = load(drow + j, c) * Vec::loadu(w + j, c);
            (rs * (gj - a - xhat_of(j, c) * b)).store(dxs + r * C + j, c);
          });
        }
      }
    });
  });
  float* dws = dweight.data_ptr<float>();
  float* dbs = dbias.data_ptr<float>();
  std::fill(dws, dws + C, 0.0f);
  std::fill(dbs, dbs + C, 0.0f);
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {  // row by row of the buffer: in cache
    const float* dw = partial.data() + static_cast<size_t>(chunk) * 2 * C;
    for (int64_t j = 0; j < C; ++j) {
      dws[j] += dw[j];
      dbs[j] += dw[C + j];
    }
  }
}

}  // namespace mixprec::models::kernels::MIXPREC_KERNEL_ISA
