// Fuzzes the JSON files of a checkpoint folder: checksums.json (which
// verify_checkpoint reads first) and optimizer.json (param groups, for SGD or
// AdamW). The first byte picks the file and the optimizer, the rest is its text.
#include "fuzz_util.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/optim/adamw.h"

#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;

// A checkpoint folder holding one small file, made once per process.
const fs::path& checkpoint_dir() {
  static const fs::path dir = [] {
    std::string pattern = (fs::temp_directory_path() / "mixprec_fuzz_XXXXXX").string();
    if (!::mkdtemp(pattern.data())) mixprec::fuzz::finding("setup", "mkdtemp failed");
    std::ofstream(fs::path(pattern) / "model.safetensors") << "abc";
    std::atexit([] { fs::remove_all(checkpoint_dir()); });
    return fs::path(pattern);
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(mixprec::fuzz::as_text(data + 1, size - 1));
  if (data[0] & 1) {
    std::ofstream(checkpoint_dir() / "checksums.json", std::ios::binary | std::ios::trunc) << text;
    mixprec::fuzz::expect_clear_error_or_success(
        [&] { mixprec::io::verify_checkpoint(checkpoint_dir()); });
  } else if (data[0] & 2) {  // AdamW's hyperparameters: betas, eps, amsgrad, maximize, ...
    static std::vector<at::Tensor> params = {at::zeros({2}), at::zeros({3})};
    mixprec::optim::AdamW adamw(params, mixprec::optim::AdamWOptions(0.1));
    mixprec::io::OptimizerState state{{}, text};
    mixprec::fuzz::expect_clear_error_or_success(
        [&] { mixprec::io::load_optimizer_state(adamw, state, "fuzz"); });
  } else {
    static std::vector<at::Tensor> params = {at::zeros({2}), at::zeros({3})};
    torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    mixprec::io::OptimizerState state{{{"state.0.momentum_buffer", at::ones({2})}}, text};
    mixprec::fuzz::expect_clear_error_or_success(
        [&] { mixprec::io::load_optimizer_state(sgd, state, "fuzz"); });
  }
  return 0;
}
