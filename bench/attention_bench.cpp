// Milliseconds of causal attention, forward + backward, per kernel of
// mixprec::models::scaled_dot_product_attention (LibTorch's flash kernel in the inputs' dtype,
// the same on fp32 up-casts, mixprec's matmul kernel) and the one kAuto picks, per dtype and
// (batch, heads, T, head dim); median of --reps timed calls after one warm-up. Prints the
// Markdown table that include/mixprec/models/attention.h quotes. With --packed, GPT-2's attention
// on its packed (B, T, 3 C) projection instead, in bf16, three ways: the heads split, made
// dense, attended (kAuto) and merged; the same on the heads' strided views; and
// packed_self_attention.
//
//   build/bench/attention_bench [--reps 11] [--threads 2] [--packed]
#include <mixprec/models/attention.h>

#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include "timed_steps.h"

#include <array>
#include <cstdio>

// --packed: one row per (B, heads, T, head dim).
int packed_projection(int reps) {
  std::printf(
      "| (B, heads, T, head dim) | split, dense heads, merge | split, strided heads, merge | "
      "packed_self_attention |\n|---|---|---|---|\n");
  for (auto [B, H, T, D] : {std::array<int64_t, 4>{8, 4, 128, 32}, {8, 8, 256, 64}}) {
    const int64_t C = H * D;
    const auto qkv = torch::randn({B, T, 3 * C}).to(torch::kBFloat16).requires_grad_();
    const auto grad = torch::randn({B, T, C}).to(torch::kBFloat16);
    auto composed = [&](bool dense) {
      std::vector<torch::Tensor> in;
      for (const auto& t : qkv.split(C, 2)) {
        auto head = t.view({B, T, H, D}).transpose(1, 2);
        in.push_back(dense ? head.contiguous() : head);
      }
      return mixprec::models::scaled_dot_product_attention(in[0], in[1], in[2], 0.0, true)
          .transpose(1, 2)
          .reshape({B, T, C});
    };
    std::printf("| (%ld, %ld, %ld, %ld) |", B, H, T, D);
    for (int way = 0; way < 3; ++way) {
      const double ms = 1e3 * median_seconds(
                                  [&] {
                                    auto out = way < 2 ? composed(way == 0)
                                                       : mixprec::models::packed_self_attention(
                                                             qkv, H, 0.0, true);
                                    out.backward(grad);
                                  },
                                  reps);
      std::printf(" %.2f |", ms);
    }
    std::printf("\n");
  }
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Causal attention forward + backward per kernel"};
  int reps = 11, threads = 2;
  bool packed = false;
  app.add_option("--reps", reps)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_flag("--packed", packed, "GPT-2's attention on its packed projection, in bf16");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  torch::manual_seed(0);
  if (packed) return packed_projection(reps);
  using mixprec::models::AttentionKernel;
  constexpr std::array kernels{AttentionKernel::kFlash, AttentionKernel::kFlashFp32,
                               AttentionKernel::kMatmul, AttentionKernel::kAuto};
  std::printf(
      "| (B, heads, T, head dim) | dtype | flash | flash on fp32 | matmul | auto |\n"
      "|---|---|---|---|---|---|\n");
  for (auto shape : {std::array<int64_t, 4>{8, 4, 128, 32},
                     {8, 8, 256, 64},
                     {8, 8, 512, 64},
                     {4, 12, 1024, 64}}) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      std::vector<torch::Tensor> in;
      for (int i = 0; i < 3; ++i) in.push_back(torch::randn(shape).to(dtype).requires_grad_());
      const auto grad = torch::randn(shape).to(dtype);
      std::printf("| (%ld, %ld, %ld, %ld) | %s |", shape[0], shape[1], shape[2], shape[3],
                  c10::toString(dtype));
      for (auto kernel : kernels) {
        const double ms = 1e3 * median_seconds(
                                    [&] {
                                      auto out = mixprec::models::scaled_dot_product_attention(
                                          in[0], in[1], in[2], 0.0, /*is_causal=*/true, kernel);
                                      out.backward(grad);
                                    },
                                    reps);
        std::printf(" %.1f |", ms);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
