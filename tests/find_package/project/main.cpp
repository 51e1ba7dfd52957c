#include <mixprec/amp/autocast.h>
#include <mixprec/amp/grad_scaler.h>
#include <mixprec/data/tokenizer.h>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  mixprec::amp::GradScaler scaler({.init_scale = 4.0});
  at::Tensor scaled;
  {
    mixprec::amp::Autocast autocast(at::kCPU, at::kBFloat16);
    scaled = scaler.scale(at::ones({2}));
  }
  const mixprec::data::ByteTokenizer tokenizer({"<|endoftext|>"});
  const bool ok = scaled.sum().item<float>() == 8.0f && scaler.get_scale() == 4.0 &&
                  tokenizer.decode(tokenizer.encode("hi<|endoftext|>")) == "hi<|endoftext|>";
  std::cout << (ok ? "downstream: ok" : "downstream: wrong result") << std::endl;
  return ok ? 0 : 1;
}
