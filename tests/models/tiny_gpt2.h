// The tiny GPT-2 the training tests of this folder share.
#pragma once

#include "mixprec/models/gpt2.h"

namespace models_test {

// Dropout off, so that two runs differ only in what they test; small enough
// to train 50-100 steps in a second on one thread.
inline mixprec::models::GPT2Config tiny_gpt2_config() {
  return {.vocab_size = 256,
          .n_positions = 64,
          .n_embd = 64,
          .n_layer = 2,
          .n_head = 4,
          .resid_pdrop = 0.0,
          .embd_pdrop = 0.0,
          .attn_pdrop = 0.0};
}

}  // namespace models_test
