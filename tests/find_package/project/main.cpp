#include <mixprec/amp/autocast.h>
#include <mixprec/amp/grad_scaler.h>
#include <mixprec/data/dataloader.h>
#include <mixprec/data/tokenizer.h>
#include <mixprec/optim/clip_grad.h>

#include <ATen/ATen.h>

#include <cmath>
#include <iostream>

int main() {
  mixprec::amp::GradScaler scaler({.init_scale = 4.0});
  at::Tensor scaled;
  {
    mixprec::amp::Autocast autocast(at::kCPU, at::kBFloat16);
    scaled = scaler.scale(at::ones({2}));
  }
  // The data headers need nothing beyond LibTorch (nlohmann-json stays inside mixprec).
  auto numbers = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", at::arange(10)}});
  mixprec::data::DataLoader loader(numbers, {.batch_size = 4, .shuffle = true});
  int64_t total = 0;
  for (const auto& batch : loader) total += batch.at("x").sum().item<int64_t>();
  const mixprec::data::ByteTokenizer tokenizer({"<|endoftext|>"});
  // The kernels (OpenMP, LibTorch's libgomp) link through the installed config: clipping runs
  // on them for fp32 CPU gradients.
  auto weight = at::zeros({300000}).requires_grad_();
  weight.mutable_grad() = at::full({300000}, 0.01);
  const double norm = mixprec::optim::clip_grad_norm_({weight}, /*max_norm=*/1.0);
  const bool ok = scaled.sum().item<float>() == 8.0f && scaler.get_scale() == 4.0 && total == 45 &&
                  loader.size() == 3 && std::abs(norm - std::sqrt(30.0)) < 1e-4 &&
                  std::abs(weight.grad()[0].item<double>() - 0.01 / std::sqrt(30.0)) < 1e-8 &&
                  tokenizer.decode(tokenizer.encode("hi<|endoftext|>")) == "hi<|endoftext|>";
  std::cout << (ok ? "downstream: ok" : "downstream: wrong result") << std::endl;
  return ok ? 0 : 1;
}
