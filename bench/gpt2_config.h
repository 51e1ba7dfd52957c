// The GPT-2 sizes of the benchmarks, one definition for all of them: small = 2 layers x 128,
// 4 heads, T 128; large = 6 layers x 512, 8 heads, T 256; V 4096; dropout off.
#pragma once

#include <mixprec/models/gpt2.h>

inline mixprec::models::GPT2Config bench_gpt2_config(bool large) {
  return {.vocab_size = 4096,
          .n_positions = large ? 256 : 128,
          .n_embd = large ? 512 : 128,
          .n_layer = large ? 6 : 2,
          .n_head = large ? 8 : 4,
          .resid_pdrop = 0.0,
          .embd_pdrop = 0.0,
          .attn_pdrop = 0.0};
}
