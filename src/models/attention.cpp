#include "mixprec/models/attention.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace mixprec::models {
namespace {

bool computes_in_fp32(const at::Tensor& query, AttentionPrecision precision) {
  const auto dtype = query.scalar_type();
  if (!query.is_cpu() || (dtype != at::kHalf && dtype != at::kBFloat16)) return false;
  switch (precision) {
    case AttentionPrecision::kNative:
      return false;
    case AttentionPrecision::kFp32:
      return true;
    case AttentionPrecision::kAuto:
      break;
  }
  return dtype == at::kHalf || query.size(-2) <= 128;  // the table in attention.h
}

}  // namespace

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value, double dropout_p, bool is_causal,
                                        AttentionPrecision precision) {
  if (!computes_in_fp32(query, precision))
    return at::scaled_dot_product_attention(query, key, value, /*attn_mask=*/{}, dropout_p,
                                            is_causal);
  // Autocast would cast the fp32 inputs straight back to 16 bits (SDPA is on its 16-bit list).
  at::Tensor out;
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    out = at::scaled_dot_product_attention(query.to(at::kFloat), key.to(at::kFloat),
                                           value.to(at::kFloat), /*attn_mask=*/{}, dropout_p,
                                           is_causal);
  }
  return out.to(query.scalar_type());
}

}  // namespace mixprec::models
