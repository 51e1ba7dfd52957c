// The digits task shared by the level-1 example and its benchmark: scikit-learn's
// handwritten digits (scripts/setup writes data/digits.csv) and an MLP classifier.
#pragma once

#include <torch/torch.h>

#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace digits {

struct Dataset {
  torch::Tensor images;  // (N, 64) fp32 in [0, 1]
  torch::Tensor labels;  // (N,) int64
};

// Reads the 64 pixel columns and the label of data/digits.csv.
inline Dataset load_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open (run scripts/setup to create it)");
  std::string line;
  std::getline(in, line);  // header
  std::vector<float> pixels;
  std::vector<int64_t> labels;
  for (int lineno = 2; std::getline(in, line); ++lineno) {
    std::stringstream fields(line);
    std::string field;
    std::vector<float> row;
    while (std::getline(fields, field, ',')) row.push_back(std::stof(field));
    if (row.size() != 65)
      throw std::runtime_error(path + ":" + std::to_string(lineno) + ": expected 65 columns, got " +
                               std::to_string(row.size()));
    const auto label = static_cast<int64_t>(row.back());
    if (label < 0 || label > 9)
      throw std::runtime_error(path + ":" + std::to_string(lineno) + ": label " +
                               std::to_string(label) + " out of range 0..9");
    for (size_t i = 0; i < 64; ++i) pixels.push_back(row[i] / 16.0f);
    labels.push_back(label);
  }
  if (labels.empty()) throw std::runtime_error(path + ": no rows");
  const auto n = static_cast<int64_t>(labels.size());
  return {torch::tensor(pixels).reshape({n, 64}), torch::tensor(labels)};
}

struct MLPImpl : torch::nn::Module {
  MLPImpl(int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(64, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        out(register_module("out", torch::nn::Linear(hidden, 10))) {}
  torch::Tensor forward(torch::Tensor x) {  // (B, 64) -> (B, 10) logits
    x = torch::relu(fc1(x));
    x = torch::relu(fc2(x));
    return out(x);
  }
  torch::nn::Linear fc1, fc2, out;
};
TORCH_MODULE(MLP);

// A fixed 80/20 train/validation split by seed.
inline std::pair<Dataset, Dataset> split(const Dataset& all, uint64_t seed) {
  torch::manual_seed(seed);
  auto perm = torch::randperm(all.images.size(0));
  const int64_t n_train = all.images.size(0) * 8 / 10;
  auto pick = [&](int64_t from, int64_t to) {
    auto idx = perm.slice(0, from, to);
    return Dataset{all.images.index_select(0, idx), all.labels.index_select(0, idx)};
  };
  return {pick(0, n_train), pick(n_train, all.images.size(0))};
}

}  // namespace digits
