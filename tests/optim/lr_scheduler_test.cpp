// Learning-rate schedules against transformers.get_scheduler (the values of
// tests/reference/lr_schedules.py): the same double arithmetic, so the lrs
// must agree to a few ulps (rtol 1e-12).
#include "mixprec/optim/lr_scheduler.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace {

using json = nlohmann::json;
using mixprec::optim::get_scheduler;
using mixprec::optim::SchedulerOptions;

json reference() { return mixprec::testing::load_reference("lr_schedules.json")["cases"]; }

mixprec::optim::SchedulerKwargs kwargs_of(const json& object) {
  mixprec::optim::SchedulerKwargs kwargs;
  for (const auto& [key, value] : object.items()) {
    if (value.is_string())
      kwargs.emplace(key, value.get<std::string>());
    else
      kwargs.emplace(key, value.get<double>());
  }
  return kwargs;
}

// Two param groups with their own lr, as the reference script makes them.
struct TwoGroups {
  torch::Tensor a = torch::zeros({1}, torch::requires_grad());
  torch::Tensor b = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD sgd{
      {torch::optim::OptimizerParamGroup({a}),
       torch::optim::OptimizerParamGroup({b}, std::make_unique<torch::optim::SGDOptions>(0.5))},
      torch::optim::SGDOptions(0.1)};
};

TEST(LRScheduler, MatchesTransformersGetScheduler) {
  const json cases = reference();
  ASSERT_EQ(cases.size(), 36u);
  for (const auto& c : cases) {
    TwoGroups model;
    SchedulerOptions options{.num_warmup_steps = c["num_warmup_steps"].get<int64_t>(),
                             .num_training_steps = c["num_training_steps"].get<int64_t>()};
    // As TrainingArguments' lr_scheduler_kwargs reach it.
    mixprec::optim::set_scheduler_kwargs(options, c["name"], kwargs_of(c["kwargs"]));
    auto scheduler = get_scheduler(c["name"].get<std::string>(), model.sgd, options);
    const std::string label = c.dump();
    for (const auto& expected : c["lrs"]) {
      const auto& got = scheduler.get_last_lr();
      ASSERT_EQ(got.size(), 2u);
      for (size_t g = 0; g < 2; ++g) {
        const double want = expected[g].get<double>();
        EXPECT_NEAR(got[g], want, 1e-12 * std::abs(want) + 1e-300) << label;
        EXPECT_EQ(model.sgd.param_groups()[g].options().get_lr(), got[g]);
      }
      model.sgd.step();
      scheduler.step();
    }
  }
}

TEST(LRScheduler, StateDictRestoresThePosition) {
  TwoGroups first, second;
  auto a = get_scheduler("cosine", first.sgd, {.num_warmup_steps = 3, .num_training_steps = 20});
  for (int i = 0; i < 7; ++i) a.step();
  auto b = get_scheduler("cosine", second.sgd, {.num_warmup_steps = 3, .num_training_steps = 20});
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.last_epoch(), 7);
  EXPECT_EQ(b.get_last_lr(), a.get_last_lr());
  EXPECT_EQ(second.sgd.param_groups()[1].options().get_lr(), a.get_last_lr()[1]);
  a.step();
  b.step();
  EXPECT_EQ(b.get_last_lr(), a.get_last_lr());
}

TEST(LRScheduler, BadArgumentsAreClearErrors) {
  TwoGroups model;
  try {
    get_scheduler("cosine_annealing", model.sgd);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("Unknown lr_scheduler_type 'cosine_annealing'; expected one of: linear,"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_THROW(get_scheduler("linear", model.sgd, {.num_warmup_steps = 2}), c10::Error);
  EXPECT_THROW(get_scheduler("polynomial", model.sgd,
                             {.num_training_steps = 10, .lr_end = 1.0}),  // > lr 0.1
               c10::Error);
  EXPECT_THROW(
      get_scheduler("linear", model.sgd, {.num_warmup_steps = -1, .num_training_steps = 5}),
      c10::Error);
  // Its decay would divide 0 by 0 at step 5 (transformers raises there).
  EXPECT_NE(mixprec::testing::error_of([&] {
              get_scheduler("polynomial", model.sgd,
                            {.num_warmup_steps = 5, .num_training_steps = 5});
            }).find("polynomial: num_training_steps (5) equals num_warmup_steps (5)"),
            std::string::npos);
  // cosine_with_min_lr and its twin: exactly one of min_lr and min_lr_rate, as transformers'.
  EXPECT_EQ(mixprec::testing::error_of(
                [&] { get_scheduler("cosine_with_min_lr", model.sgd, {.num_training_steps = 5}); }),
            "One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`");
  EXPECT_EQ(mixprec::testing::error_of([&] {
              get_scheduler("cosine_with_min_lr", model.sgd,
                            {.num_training_steps = 5, .min_lr = 1e-3, .min_lr_rate = 0.1});
            }),
            "Only one of min_lr or min_lr_rate should be set");
  EXPECT_EQ(mixprec::testing::error_of([&] {
              get_scheduler("cosine_warmup_with_min_lr", model.sgd, {.num_training_steps = 5});
            }),
            "One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`");
  // warmup_stable_decay: num_decay_steps is required, and a length for the stable phase.
  EXPECT_EQ(mixprec::testing::error_of([&] {
              get_scheduler("warmup_stable_decay", model.sgd, {.num_training_steps = 5});
            }),
            "warmup_stable_decay requires `num_decay_steps`; set it through the "
            "`lr_scheduler_kwargs`");
  EXPECT_EQ(mixprec::testing::error_of(
                [&] { get_scheduler("warmup_stable_decay", model.sgd, {.num_decay_steps = 5}); }),
            "Either num_training_steps or num_stable_steps must be specified.");
  SchedulerOptions wsd{.num_training_steps = 20, .num_decay_steps = 5};
  EXPECT_EQ(
      mixprec::testing::error_of([&] {
        mixprec::optim::set_scheduler_kwargs(wsd, "warmup_stable_decay",
                                             {{"num_stable_steps", -1}});
      }),
      "lr_scheduler_kwargs: num_stable_steps must be a non-negative integer below 2^53, got -1");
  mixprec::testing::CapturedWarnings warnings;
  wsd.num_stable_steps = 4;
  get_scheduler("warmup_stable_decay", model.sgd, wsd);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("num_stable_steps will be used"), std::string::npos);
}

}  // namespace
