// Level 2: the same digits classifier as amp_loop.cpp, through the Accelerator:
// mixed precision, gradient accumulation, clipping, a warm-up schedule and
// TensorBoard/JSONL logs, by changing a few lines of the plain loop. Runs in
// one process, or data parallel under torchrun:
//
//   build/examples/accelerate_loop --mixed-precision fp16
//   torchrun --nproc-per-node 2 --no-python build/examples/accelerate_loop --mixed-precision bf16
#include <mixprec/accelerate/accelerator.h>
#include <mixprec/optim/adamw.h>
#include <mixprec/optim/lr_scheduler.h>

#include "digits.h"

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  CLI::App app{"mixprec level 2: the Accelerator on the digits dataset"};
  std::string mixed_precision = "bf16", data = "data/digits.csv", log_dir = "runs";
  int epochs = 10;
  int64_t batch_size = 32, accumulation = 2, hidden = 256;
  double lr = 3e-3, max_grad_norm = 1.0;
  app.add_option("--mixed-precision", mixed_precision, "no, bf16 or fp16")
      ->check(CLI::IsMember({"no", "bf16", "fp16"}));
  app.add_option("--data", data, "digits CSV written by scripts/setup");
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "per process")->check(CLI::PositiveNumber);
  app.add_option("--gradient-accumulation-steps", accumulation)->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden)->check(CLI::PositiveNumber);
  app.add_option("--lr", lr);
  app.add_option("--max-grad-norm", max_grad_norm);
  app.add_option("--log-dir", log_dir, "TensorBoard and JSONL logs go to LOG_DIR/accelerate_loop");
  CLI11_PARSE(app, argc, argv);

  try {
    mixprec::Accelerator accelerator({.mixed_precision = mixed_precision,
                                      .gradient_accumulation_steps = accumulation,
                                      .log_with = {"tensorboard", "jsonl"},
                                      .project_dir = log_dir});
    mixprec::accelerate::set_seed(0);
    const auto [train_set, val_set] = digits::split(digits::load_csv(data), 0);
    digits::MLP net(hidden);
    mixprec::optim::AdamW adamw(net->parameters(), mixprec::optim::AdamWOptions(lr).fused(true));
    // Each process takes every num_processes-th batch of the epoch's order.
    const int64_t world = accelerator.num_processes(), rank = accelerator.process_index();
    const int64_t batches = train_set.images.size(0) / (batch_size * world);
    // As in Accelerate: the schedule counts single-process batches; the prepared
    // scheduler advances num_processes times per optimizer step.
    const int64_t optimizer_steps = epochs * (train_set.images.size(0) / batch_size / accumulation);
    auto schedule = mixprec::optim::get_scheduler(
        "linear", adamw,
        {.num_warmup_steps = optimizer_steps / 10, .num_training_steps = optimizer_steps});
    auto [model, optimizer, scheduler] = accelerator.prepare(net, adamw, schedule);
    accelerator.init_trackers("accelerate_loop");

    int64_t step = 0;
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      model->train();
      auto order = torch::randperm(train_set.images.size(0));  // same seed: same on every rank
      double loss_sum = 0;
      for (int64_t b = 0; b < batches; ++b) {
        auto idx =
            order.slice(0, (b * world + rank) * batch_size, (b * world + rank + 1) * batch_size);
        auto guard = accelerator.accumulate(model);
        auto loss = torch::nn::functional::cross_entropy(
            model(train_set.images.index_select(0, idx)), train_set.labels.index_select(0, idx));
        accelerator.backward(loss);
        if (accelerator.sync_gradients()) {
          const double norm = accelerator.clip_grad_norm_(net->parameters(), max_grad_norm);
          optimizer.step();
          scheduler.step();
          optimizer.zero_grad();
          ++step;
          std::map<std::string, double> scalars = {
              {"train/loss", loss.item<double>()},
              {"train/grad_norm", norm},
              {"train/learning_rate", scheduler.get_last_lr()[0]}};
          if (auto* scaler = accelerator.scaler())
            scalars["train/loss_scale"] = scaler->get_scale();
          accelerator.log(scalars, step);
        }
        loss_sum += loss.item<double>();
      }
      model->eval();
      torch::NoGradGuard no_grad;
      auto predicted = model(val_set.images).argmax(1);
      const double accuracy = predicted.eq(val_set.labels).to(torch::kFloat).mean().item<double>();
      accelerator.log({{"eval/accuracy", accuracy}}, step);
      // As amp_loop prints it: scale 1 without a scaler (a disabled GradScaler's get_scale()).
      auto* scaler = accelerator.scaler();
      char line[160];
      std::snprintf(line, sizeof line,
                    "%s epoch %2d/%d  loss %.4f  val_acc %5.1f%%  scale %-8g skipped %s",
                    mixed_precision == "no" ? "fp32" : mixed_precision.c_str(), epoch, epochs,
                    loss_sum / static_cast<double>(batches), 100 * accuracy,
                    scaler ? scaler->get_scale() : 1.0,
                    accelerator.optimizer_step_was_skipped() ? "yes" : "no");
      accelerator.print(line);
    }
    accelerator.end_training();
    // The weights as Accelerate saves them: model.safetensors, loadable by PyTorch.
    accelerator.save_model(model, log_dir + "/accelerate_loop/model");
    accelerator.print("logs: ", log_dir, "/accelerate_loop (tensorboard --logdir ", log_dir,
                      "); weights: ", log_dir, "/accelerate_loop/model/model.safetensors");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accelerate_loop: %s\n", e.what());
    return 1;
  }
  return 0;
}
