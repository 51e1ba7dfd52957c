// GPT-2's fp32 linear layers, forward and backward: mixprec::models::linear (oneDNN's GEMMs
// for the output and the input gradient) against the LibTorch ops HF's model runs (at::addmm
// for Conv1D, at::linear for the tied LM head; MKL's GEMMs), B x T = 8 x 128 (small) and
// 8 x 256 (large) rows. The two run alternately, --reps times; the table gives median ms and
// the median of the per-rep ratios. Prints a Markdown table.
//
//   build/bench/linear_bench [--reps 21] [--threads 2]
#include <mixprec/models/linear.h>

#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include "timed_steps.h"

#include <cstdio>
#include <functional>
#include <vector>

int main(int argc, char** argv) {
  CLI::App app{"GPT-2's fp32 linear layers: mixprec::models::linear against LibTorch's ops"};
  int reps = 21, threads = 2;
  app.add_option("--reps", reps)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  torch::manual_seed(0);
  using mixprec::models::WeightLayout;

  std::printf(
      "| layer (rows x in -> out; %d threads, median of %d; oneDNN %s) | forward ms: mixprec | "
      "LibTorch | ratio | backward ms: mixprec | LibTorch | ratio |\n"
      "|---|---|---|---|---|---|---|\n",
      threads, reps, mixprec::models::linear_uses_onednn() ? "on" : "off");
  struct Layer {
    const char* name;
    int64_t rows, in, out;
    WeightLayout layout;
  };
  const int64_t V = 4096;
  for (const Layer& l :
       std::vector<Layer>{{"small c_attn", 1024, 128, 384, WeightLayout::kInOut},
                          {"small attn c_proj", 1024, 128, 128, WeightLayout::kInOut},
                          {"small c_fc", 1024, 128, 512, WeightLayout::kInOut},
                          {"small mlp c_proj", 1024, 512, 128, WeightLayout::kInOut},
                          {"small LM head", 1024, 128, V, WeightLayout::kOutIn},
                          {"large c_attn", 2048, 512, 1536, WeightLayout::kInOut},
                          {"large attn c_proj", 2048, 512, 512, WeightLayout::kInOut},
                          {"large c_fc", 2048, 512, 2048, WeightLayout::kInOut},
                          {"large mlp c_proj", 2048, 2048, 512, WeightLayout::kInOut},
                          {"large LM head", 2048, 512, V, WeightLayout::kOutIn}}) {
    const bool in_out = l.layout == WeightLayout::kInOut;
    const auto x = torch::randn({l.rows, l.in}).requires_grad_();
    const auto w = (in_out ? torch::randn({l.in, l.out}) : torch::randn({l.out, l.in})) * 0.02;
    const auto weight = w.requires_grad_();
    const auto bias = in_out ? torch::zeros({l.out}).requires_grad_() : torch::Tensor();
    const auto dy = torch::randn({l.rows, l.out});
    auto ours = [&] { return mixprec::models::linear(x, weight, bias, l.layout); };
    auto libtorch = [&] { return in_out ? at::addmm(bias, x, weight) : at::linear(x, weight); };
    auto forward = [](auto f) {
      return [f] {
        torch::NoGradGuard no_grad;
        f();
      };
    };
    std::vector<torch::Tensor> inputs{x, weight};
    if (bias.defined()) inputs.push_back(bias);
    auto backward = [&](auto f) {  // the graph of one forward, run backward again and again
      return [y = f(), &inputs, &dy] {
        torch::autograd::grad({y}, inputs, {dy}, /*retain_graph=*/true);
      };
    };
    std::vector<double> fa, fb, fr, ba, bb, br;
    for (int r = 0; r <= reps; ++r) {  // rep 0 warms up; the order alternates
      auto ordered = [r](const std::function<void()>& f, const std::function<void()>& g) {
        if (r % 2 == 0) {
          const double tf = seconds(f);
          return std::pair{tf, seconds(g)};
        }
        const double tg = seconds(g);
        return std::pair{seconds(f), tg};
      };
      const auto [a, b] = ordered(forward(ours), forward(libtorch));
      const auto [c, d] = ordered(backward(ours), backward(libtorch));
      if (r == 0) continue;
      fa.push_back(a), fb.push_back(b), fr.push_back(b / a);
      ba.push_back(c), bb.push_back(d), br.push_back(d / c);
    }
    std::printf("| %s (%ld x %ld -> %ld) | %.2f | %.2f | %.2fx | %.2f | %.2f | %.2fx |\n", l.name,
                static_cast<long>(l.rows), static_cast<long>(l.in), static_cast<long>(l.out),
                1e3 * median(fa), 1e3 * median(fb), median(fr), 1e3 * median(ba), 1e3 * median(bb),
                median(br));
  }
  return 0;
}
