// Level 1: the plain PyTorch AMP loop in C++ — autocast + GradScaler — training
// an MLP classifier on scikit-learn's handwritten digits (scripts/setup writes
// data/digits.csv), in fp32, bf16 and fp16.
//
//   build/examples/amp_loop                    # all three precisions
//   build/examples/amp_loop --precision fp16 --epochs 30
#include <mixprec/amp/autocast.h>
#include <mixprec/amp/grad_scaler.h>
#include <mixprec/optim/adamw.h>

#include "digits.h"

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>

namespace {

struct Result {
  std::string precision;
  double final_loss, val_accuracy, steps_per_s, final_scale;
  int64_t skipped;
};

Result train(const std::string& precision, const digits::Dataset& train_set,
             const digits::Dataset& val_set, int epochs, int64_t batch_size, int64_t hidden,
             double lr, uint64_t seed) {
  torch::manual_seed(seed);
  digits::MLP model(hidden);
  mixprec::optim::AdamW optimizer(model->parameters(),
                                  mixprec::optim::AdamWOptions(lr).fused(true));
  // Loss scaling is for fp16 only: bf16 has fp32's exponent range.
  mixprec::amp::GradScaler scaler({.enabled = precision == "fp16"});
  const bool autocast = precision != "fp32";
  const auto dtype = precision == "fp16" ? torch::kHalf : torch::kBFloat16;

  const int64_t n = train_set.images.size(0);
  int64_t skipped = 0, steps = 0;
  double loss_sum = 0;
  auto start = std::chrono::steady_clock::now();
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    model->train();
    auto order = torch::randperm(n);
    loss_sum = 0;
    int64_t batches = 0;
    for (int64_t i = 0; i + batch_size <= n; i += batch_size) {
      auto idx = order.slice(0, i, i + batch_size);
      auto x = train_set.images.index_select(0, idx);
      auto y = train_set.labels.index_select(0, idx);
      torch::Tensor loss;
      {
        mixprec::amp::Autocast guard(torch::kCPU, dtype, autocast);
        loss = torch::nn::functional::cross_entropy(model(x), y);  // fp32 under autocast
      }
      scaler.scale(loss).backward();
      skipped += !scaler.step(optimizer);
      scaler.update();
      optimizer.zero_grad();
      loss_sum += loss.item<double>();
      ++batches;
      ++steps;
    }
    loss_sum /= batches;

    model->eval();
    torch::NoGradGuard no_grad;
    mixprec::amp::Autocast guard(torch::kCPU, dtype, autocast);
    auto predicted = model(val_set.images).argmax(1);
    const double accuracy = predicted.eq(val_set.labels).to(torch::kFloat).mean().item<double>();
    std::printf("%-4s epoch %2d/%d  loss %.4f  val_acc %5.1f%%  scale %-8g skipped %lld\n",
                precision.c_str(), epoch, epochs, loss_sum, 100 * accuracy, scaler.get_scale(),
                static_cast<long long>(skipped));
    if (epoch == epochs) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return {precision, loss_sum, accuracy, steps / seconds, scaler.get_scale(), skipped};
    }
  }
  throw std::runtime_error("epochs must be >= 1");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mixprec level 1: autocast + GradScaler on the digits dataset"};
  std::string precision = "all", data = "data/digits.csv";
  int epochs = 15;
  int64_t batch_size = 64, hidden = 256;
  double lr = 3e-3;
  uint64_t seed = 0;
  app.add_option("--precision", precision, "fp32, bf16, fp16 or all")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "all"}));
  app.add_option("--data", data, "digits CSV written by scripts/setup");
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size)->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden)->check(CLI::PositiveNumber);
  app.add_option("--lr", lr);
  app.add_option("--seed", seed);
  CLI11_PARSE(app, argc, argv);

  try {
    const auto [train_set, val_set] = digits::split(digits::load_csv(data), seed);
    const int64_t n_train = train_set.images.size(0);
    std::printf("digits: %lld train, %lld validation images\n", static_cast<long long>(n_train),
                static_cast<long long>(val_set.images.size(0)));

    std::vector<std::string> precisions = precision == "all"
                                              ? std::vector<std::string>{"fp32", "bf16", "fp16"}
                                              : std::vector<std::string>{precision};
    std::vector<Result> results;
    for (const auto& p : precisions)
      results.push_back(train(p, train_set, val_set, epochs, batch_size, hidden, lr, seed));

    std::printf("\n| precision | final loss | val accuracy | steps/s | final scale | skipped |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (const auto& r : results)
      std::printf("| %s | %.4f | %.1f%% | %.0f | %g | %lld |\n", r.precision.c_str(), r.final_loss,
                  100 * r.val_accuracy, r.steps_per_s, r.final_scale,
                  static_cast<long long>(r.skipped));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "amp_loop: %s\n", e.what());
    return 1;
  }
  return 0;
}
