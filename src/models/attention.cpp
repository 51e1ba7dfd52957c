#include "mixprec/models/attention.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/autocast_mode.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <vector>

#include "kernels/isa.h"
#include "models/kernels/attention_softmax.h"

namespace mixprec::models {

// Whether LibTorch's bf16 brgemm (oneDNN's ukernel) runs here with B in the VNNI-2 layout that
// the kernels pack, (K/2, ld_b, 2), ld_b wider than N as theirs can be: tried once, against a
// loop, on a product larger than an AMX tile (16 x 16 of C, 32 deep) and a 64-column block
// (small integers, so exact). Not with oneDNN off.
bool kernels::bf16_brgemm_runs() {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  static const bool runs = [] {
    constexpr int64_t M = 40, N = 72, K = 36, ld_a = K, ld_b = 80, ld_c = N + 4;
    std::vector<at::BFloat16> a(M * ld_a), b(K / 2 * ld_b * 2);
    std::vector<float> want(M * ld_c), got(M * ld_c);
    auto b_at = [](int64_t k, int64_t n) { return static_cast<float>((k * 7 + n * 3) % 9 - 4); };
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) a[m * ld_a + k] = static_cast<float>((m * 5 + k) % 7 - 3);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) b[(k / 2 * ld_b + n) * 2 + k % 2] = b_at(k, n);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          want[m * ld_c + n] += static_cast<float>(a[m * ld_a + k]) * b_at(k, n);
    try {
      at::native::cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, false, a.data(), b.data(), got.data(),
                                  /*is_vnni=*/true);
      at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    } catch (const std::exception&) {  // c10::Error, or oneDNN's own
      return false;
    }
    return got == want;
  }();
  return runs && at::globalContext().userEnabledMkldnn();
#else
  return false;
#endif
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using SoftmaxForward = void (*)(const at::Tensor&, int64_t, bool, float, const at::Tensor&);
using SoftmaxBackward = void (*)(const at::Tensor&, const at::Tensor&, int64_t, bool, float,
                                 const at::Tensor&);
using Bf16Forward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, float,
                             const at::Tensor&, const at::Tensor&);
using Bf16Backward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, bool, float, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&);
struct SoftmaxKernel {
  SoftmaxForward forward = nullptr;
  SoftmaxBackward backward = nullptr;
  Bf16Forward bf16_forward = nullptr;
  Bf16Backward bf16_backward = nullptr;
};

SoftmaxKernel softmax_kernel() {
#ifdef MIXPREC_HAVE_X86_KERNELS
  return mixprec::kernels::for_this_cpu<SoftmaxKernel>(
      {kernels::avx512::attention_softmax_forward, kernels::avx512::attention_softmax_backward,
       kernels::avx512::attention_bf16_forward, kernels::avx512::attention_bf16_backward},
      {kernels::avx2::attention_softmax_forward, kernels::avx2::attention_softmax_backward,
       kernels::avx2::attention_bf16_forward, kernels::avx2::attention_bf16_backward},
      {});
#else
  return {};
#endif
}

// Whether bf16 inputs take the brgemm kernels: head dims and keys even, the VNNI-2 layout's
// pairs; query and key of one head dim, nothing empty, and the same batch dims (they index the
// three alike; at::matmul broadcasts, and autograd sums the gradients of broadcast inputs).
bool bf16_kernels_run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  return query.scalar_type() == at::kBFloat16 && query.size(-1) % 2 == 0 &&
         value.size(-1) % 2 == 0 && key.size(-2) % 2 == 0 && query.numel() > 0 &&
         value.size(-1) > 0 && query.size(-1) == key.size(-1) &&
         query.sizes().slice(0, query.dim() - 2) == key.sizes().slice(0, key.dim() - 2) &&
         key.sizes().slice(0, key.dim() - 1) == value.sizes().slice(0, value.dim() - 1) &&
         softmax_kernel().bf16_forward != nullptr && kernels::bf16_brgemm_runs();
}

// SDPA's default: 1 / sqrt(head dim).
float scale_of(const at::Tensor& query) {
  return 1.0f / std::sqrt(static_cast<float>(query.size(-1)));
}

// bf16 inputs keep bf16 probabilities (what the 16-bit flash kernel feeds its second GEMM);
// fp16 ones run in fp32 (LibTorch's fp16 GEMMs are scalar loops on most CPUs).
at::ScalarType compute_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

// A dense copy of t in dtype (t itself if it is one already): at::matmul copies strided
// operands anyway, and each is used twice. (t.to(dtype, MemoryFormat::Contiguous) would return
// a strided t of that dtype as it is: it compares suggest_memory_format(), which is Contiguous
// for any strides but channels-last.)
at::Tensor dense(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype) return t.contiguous();
  return t.to(dtype, /*non_blocking=*/false, /*copy=*/false, at::MemoryFormat::Contiguous);
}

// Whether the bf16 kernels read t as it is: bf16, contiguous rows an even number of elements
// apart (the heads of a packed (B, T, 3 * C) projection are).
bool bf16_rows(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 && t.stride(-1) == 1 && t.stride(-2) >= t.size(-1) &&
         t.stride(-2) % 2 == 0;
}

// A new tensor of these sizes, dense, its dims in like's memory order (its strides' order): the
// bf16 kernels' outputs, so that the heads of a packed projection get their gradients, and their
// output, in the (B, T, heads, head dim) order that merging heads views without a copy.
// (Contiguous where that order would not end in dense rows: inputs whose matrices overlap.)
at::Tensor empty_in_order_of(const at::Tensor& like, at::IntArrayRef sizes) {
  const auto strides = at::infer_dense_strides(sizes, like.strides());
  if (strides.back() != 1) return at::empty(sizes, like.options());
  return at::empty_strided(sizes, strides, like.options());
}

// The kernels' backward records no graph: a gradient of a gradient through them would be
// silently incomplete.
void check_differentiated_once() {
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "mixprec::models attention's matmul kernel is differentiable once: its backward "
              "does not record a graph (create_graph=true); use AttentionKernel::kFlash");
}

// Scores and their gradient come from fp32 GEMMs on the (exact) up-casts, as in the flash
// kernels, which keep them in fp32 too (bf16: brgemm's fp32 sums of the exact products, by
// blocks of rows); the products with the probabilities run in the compute dtype. Saved for
// backward: the inputs (dense copies, but for the bf16 kernels) and the (B, H, Lq, Lk)
// probabilities.
struct MatmulAttention : torch::autograd::Function<MatmulAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, bool is_causal) {
    RECORD_FUNCTION("mixprec::attention", std::vector<c10::IValue>());
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto dtype = compute_dtype(query);
    // (The same for the dense copies below: same sizes, in query's dtype.)
    const bool bf16 = bf16_kernels_run(query, key, value);
    // The bf16 kernels read strided rows as they are; everything else gets dense copies.
    const bool as_is = bf16 && bf16_rows(query) && bf16_rows(key) && bf16_rows(value);
    const auto q = as_is ? query : dense(query, dtype), k = as_is ? key : dense(key, dtype),
               v = as_is ? value : dense(value, dtype);
    at::Tensor probs, out;
    if (bf16) {
      auto shape = q.sizes().vec();
      shape.back() = k.size(-2);
      probs = at::empty(shape, q.options());
      shape.back() = v.size(-1);
      out = empty_in_order_of(q, shape);
      softmax_kernel().bf16_forward(q, k, v, is_causal, scale_of(q), probs, out);
    } else {
      auto scores = at::matmul(dense(q, at::kFloat), dense(k, at::kFloat).transpose(-2, -1));
      probs = dtype == at::kFloat ? scores : at::empty_like(scores, dtype);
      softmax_kernel().forward(scores, q.size(-2), is_causal, scale_of(q), probs);
      out = at::matmul(probs, v);
    }
    ctx->save_for_backward({q, k, v, probs});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(query.scalar_type()),
                                                     static_cast<int64_t>(key.scalar_type()),
                                                     static_cast<int64_t>(value.scalar_type())};
    return out.to(query.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    RECORD_FUNCTION("mixprec::attention_backward", std::vector<c10::IValue>());
    check_differentiated_once();
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &probs = saved[3];
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const auto dtype = probs.scalar_type();
    const bool bf16 = bf16_kernels_run(q, k, v);
    // Exact: the inputs' dtype or fp32.
    const auto grad =
        bf16 && bf16_rows(grad_outputs[0]) ? grad_outputs[0] : dense(grad_outputs[0], dtype);
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    at::Tensor grad_query, grad_key, grad_value;
    if (bf16) {
      grad_query = empty_in_order_of(q, q.sizes()), grad_key = empty_in_order_of(k, k.sizes()),
      grad_value = empty_in_order_of(v, v.sizes());
      softmax_kernel().bf16_backward(q, k, v, probs, grad, is_causal, scale_of(q), grad_query,
                                     grad_key, grad_value);
    } else {
      grad_value = at::matmul(probs.transpose(-2, -1), grad);
      auto grad_probs = at::matmul(dense(grad, at::kFloat), dense(v, at::kFloat).transpose(-2, -1));
      auto grad_scores = dtype == at::kFloat ? grad_probs : at::empty_like(grad_probs, dtype);
      softmax_kernel().backward(probs, grad_probs, q.size(-2), is_causal, scale_of(q), grad_scores);
      grad_query = at::matmul(grad_scores, k);
      grad_key = at::matmul(grad_scores.transpose(-2, -1), q);
    }
    const auto as = [&](int i) { return static_cast<at::ScalarType>(dtypes[i]); };
    return {grad_query.to(as(0)), grad_key.to(as(1)), grad_value.to(as(2)), {}};
  }
};

// (B, T, C) as (B, heads, T, C / heads), GPT-2's heads: views where the last dim is dense (as
// where the kernels write).
at::Tensor heads_of(const at::Tensor& t, int64_t n_head) {
  return t.reshape({t.size(0), t.size(1), n_head, t.size(2) / n_head}).transpose(1, 2);
}

// The query, key and value heads of a packed (B, T, 3 C) projection.
std::vector<at::Tensor> split_heads(const at::Tensor& qkv, int64_t n_head) {
  std::vector<at::Tensor> heads;
  for (const auto& t : qkv.split(qkv.size(2) / 3, 2)) heads.push_back(heads_of(t, n_head));
  return heads;
}

// The bf16 kernels on a packed projection: they read the heads where they are, write the
// output's in (B, T, C) order and the gradients' into one (B, T, 3 C) tensor, so that neither
// the merge of the heads nor the split's backward (a cat) copies them.
struct PackedBf16Attention : torch::autograd::Function<PackedBf16Attention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& qkv, int64_t n_head,
                            bool is_causal) {
    RECORD_FUNCTION("mixprec::attention", std::vector<c10::IValue>());
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto in = split_heads(qkv, n_head);
    const int64_t B = qkv.size(0), T = qkv.size(1);
    auto probs = at::empty({B, n_head, T, T}, qkv.options());
    auto out = at::empty({B, T, qkv.size(2) / 3}, qkv.options());
    softmax_kernel().bf16_forward(in[0], in[1], in[2], is_causal, scale_of(in[0]), probs,
                                  heads_of(out, n_head));
    ctx->save_for_backward({qkv, probs});
    ctx->saved_data["n_head"] = n_head;
    ctx->saved_data["is_causal"] = is_causal;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    RECORD_FUNCTION("mixprec::attention_backward", std::vector<c10::IValue>());
    check_differentiated_once();
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto &qkv = saved[0], &probs = saved[1];
    const int64_t n_head = ctx->saved_data["n_head"].toInt();
    const auto in = split_heads(qkv, n_head);
    auto grad_qkv = at::empty_like(qkv, at::MemoryFormat::Contiguous);
    const auto grads = split_heads(grad_qkv, n_head);
    softmax_kernel().bf16_backward(in[0], in[1], in[2], probs,
                                   heads_of(grad_outputs[0].to(at::kBFloat16).contiguous(), n_head),
                                   ctx->saved_data["is_causal"].toBool(), scale_of(in[0]), grads[0],
                                   grads[1], grads[2]);
    return {grad_qkv, {}, {}};
  }
};

bool matmul_supported(const at::Tensor& query, const at::Tensor& key, double dropout_p) {
  const auto dtype = query.scalar_type();
  return query.is_cpu() && dropout_p == 0.0 && key.size(-2) > 0 &&
         softmax_kernel().forward != nullptr &&
         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
}

}  // namespace

AttentionKernel choose_attention_kernel(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, double dropout_p) {
  const auto dtype = query.scalar_type();
  const bool sixteen_bit = dtype == at::kHalf || dtype == at::kBFloat16;
  if (!query.is_cpu() || !(sixteen_bit || dtype == at::kFloat)) return AttentionKernel::kFlash;
  // The tables in attention.h.
  const int64_t T = std::max(query.size(-2), key.size(-2));
  if (matmul_supported(query, key, dropout_p) &&
      (T <= 128 ||
       (dtype == at::kBFloat16 && T <= (bf16_kernels_run(query, key, value) ? 512 : 256))))
    return AttentionKernel::kMatmul;
  if (dtype == at::kFloat) return AttentionKernel::kFlash;
  // With AMX-BF16, LibTorch's bf16 flash kernel overtakes fp32's above T = 128.
  const int64_t bf16_in_fp32_up_to = mixprec::kernels::cpu_has_amx_bf16() ? 128 : 256;
  return dtype == at::kHalf || T <= bf16_in_fp32_up_to ? AttentionKernel::kFlashFp32
                                                       : AttentionKernel::kFlash;
}

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, double dropout_p, bool is_causal,
                                        AttentionKernel kernel) {
  // As PyTorch's: mixed dtypes are an error, except under autocast, which casts them alike.
  TORCH_CHECK(
      (query.scalar_type() == key.scalar_type() && query.scalar_type() == value.scalar_type()) ||
          at::autocast::is_autocast_enabled(query.device().type()),
      "Expected query, key, and value to have the same dtype, but got query.dtype: ",
      query.scalar_type(), " key.dtype: ", key.scalar_type(),
      " and value.dtype: ", value.scalar_type(), " instead.");
  if (kernel == AttentionKernel::kAuto)
    kernel = choose_attention_kernel(query, key, value, dropout_p);
  TORCH_CHECK(kernel != AttentionKernel::kMatmul || matmul_supported(query, key, dropout_p),
              "scaled_dot_product_attention: AttentionKernel::kMatmul needs CPU tensors of float, "
              "bfloat16 or half, dropout_p 0, keys and an AVX2 or AVX-512 CPU; got ",
              query.device(), " ", query.scalar_type(), ", dropout_p ", dropout_p, ", ",
              key.size(-2), " keys");
  switch (kernel) {
    case AttentionKernel::kMatmul:
      return MatmulAttention::apply(query, key, value, is_causal);
    case AttentionKernel::kFlashFp32: {
      // Autocast would cast the fp32 inputs straight back to 16 bits (SDPA is on its 16-bit
      // list).
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      return at::scaled_dot_product_attention(query.to(at::kFloat), key.to(at::kFloat),
                                              value.to(at::kFloat), /*attn_mask=*/{}, dropout_p,
                                              is_causal)
          .to(query.scalar_type());
    }
    default:
      return at::scaled_dot_product_attention(query, key, value, /*attn_mask=*/{}, dropout_p,
                                              is_causal);
  }
}

at::Tensor packed_self_attention(const at::Tensor& qkv, int64_t n_head, double dropout_p,
                                 bool is_causal) {
  TORCH_CHECK(qkv.dim() == 3 && n_head > 0 && qkv.size(2) % (3 * n_head) == 0,
              "packed_self_attention: qkv must be (B, T, 3 * C) with C a multiple of n_head (",
              n_head, "); got ", qkv.sizes());
  const auto heads = split_heads(qkv, n_head);
  if (choose_attention_kernel(heads[0], heads[1], heads[2], dropout_p) ==
          AttentionKernel::kMatmul &&
      bf16_rows(heads[0]) && bf16_kernels_run(heads[0], heads[1], heads[2]))
    return PackedBf16Attention::apply(qkv, n_head, is_causal);
  return scaled_dot_product_attention(heads[0], heads[1], heads[2], dropout_p, is_causal)
      .transpose(1, 2)
      .reshape({qkv.size(0), qkv.size(1), qkv.size(2) / 3});
}

}  // namespace mixprec::models
