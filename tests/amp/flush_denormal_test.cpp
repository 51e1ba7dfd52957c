#include "mixprec/amp/flush_denormal.h"

#include "mixprec/optim/adamw.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

namespace {

using mixprec::amp::set_flush_denormal;

constexpr float kMinNormal = std::numeric_limits<float>::min();
constexpr int64_t kElements = 1 << 20;  // enough for LibTorch to split a mul over its threads

// How many of kElements halvings of the smallest normal float come out 0 (flushed) rather
// than subnormal, in LibTorch's mul kernel, which runs on all of its threads.
int64_t flushed() {
  return (torch::full({kElements}, kMinNormal) * 0.5f == 0).sum().item<int64_t>();
}

// Built without OpenMP, set_flush_denormal reaches the calling thread only.
bool reaches_the_pool() { return MIXPREC_WITH_OPENMP || at::get_num_threads() == 1; }

TEST(FlushDenormal, ReachesEveryThreadOfARunningPool) {
  if (!at::globalContext().setFlushDenormal(false)) GTEST_SKIP() << "no FTZ/DAZ on this CPU";
  if (!reaches_the_pool()) GTEST_SKIP() << "mixprec built without OpenMP";
  EXPECT_EQ(flushed(), 0);  // the pool has run now, in the default mode
  if (at::get_num_threads() > 1) {
    // LibTorch's own call reaches the calling thread's part of the work only.
    ASSERT_TRUE(at::globalContext().setFlushDenormal(true));
    const int64_t by_libtorchs = flushed();
    EXPECT_GT(by_libtorchs, 0);
    EXPECT_LT(by_libtorchs, kElements);
    ASSERT_TRUE(at::globalContext().setFlushDenormal(false));
  }
  ASSERT_TRUE(set_flush_denormal(true));
  EXPECT_EQ(flushed(), kElements);
  ASSERT_TRUE(set_flush_denormal(false));
  EXPECT_EQ(flushed(), 0);
  // Within a parallel region it would set one thread of it: an error.
  at::parallel_for(0, 1, 1,
                   [](int64_t, int64_t) { EXPECT_THROW(set_flush_denormal(true), c10::Error); });
  EXPECT_EQ(flushed(), 0);
}

// LibTorch's fused AdamW, split over its threads, on moments that decay with zero gradients:
// subnormal by default, 0 with the mode on.
TEST(FlushDenormal, AdamWMomentsOfZeroGradientsAreSubnormalByDefaultAndZeroWithIt) {
  if (!at::globalContext().setFlushDenormal(false)) GTEST_SKIP() << "no FTZ/DAZ on this CPU";
  if (!reaches_the_pool()) GTEST_SKIP() << "mixprec built without OpenMP";
  const auto run = [](bool flush) {
    EXPECT_TRUE(set_flush_denormal(flush));
    auto p = torch::ones({kElements}, torch::requires_grad());
    mixprec::optim::AdamW opt({p}, mixprec::optim::AdamWOptions(1e-3).fused(true));
    p.mutable_grad() = torch::full({kElements}, 1e-36f);  // exp_avg 1e-37 after this step
    opt.step();
    p.mutable_grad().zero_();  // then 0.9x a step: subnormal from the 21st such step on
    for (int i = 0; i < 25; ++i) opt.step();
    set_flush_denormal(false);
    const auto& state = static_cast<const mixprec::optim::AdamWParamState&>(
        *opt.state().at(p.unsafeGetTensorImpl()));
    return state.exp_avg().clone();
  };
  const auto m_default = run(false), m_flushed = run(true);
  EXPECT_TRUE((m_default > 0).all().item<bool>());
  EXPECT_TRUE((m_default < kMinNormal).all().item<bool>());
  EXPECT_TRUE((m_flushed == 0).all().item<bool>());
}

}  // namespace
