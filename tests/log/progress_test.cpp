#include "mixprec/log/progress.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace {

using mixprec::log::ProgressBar;

TEST(ProgressBar, FormatsLikeTqdm) {
  EXPECT_EQ(ProgressBar::format("train", 42, 100, 10.0, "loss=0.512"),
            "train:  42%|████▏     | 42/100 [00:10<00:13, 4.20it/s, loss=0.512]");
  EXPECT_EQ(ProgressBar::format("", 100, 100, 3725.0, ""),
            "100%|██████████| 100/100 [1:02:05<00:00, 37.25s/it]");
  EXPECT_EQ(ProgressBar::format("eval", 0, 8, 0.0, ""),
            "eval:   0%|          | 0/8 [00:00<?, 0.00it/s]");
}

TEST(ProgressBar, OffWhenNotATerminal) {
  std::FILE* file = std::tmpfile();
  {
    ProgressBar bar(10, "train", {.stream = file});  // a file is no terminal
    EXPECT_FALSE(bar.enabled());
    bar.update(10);
  }
  EXPECT_EQ(std::ftell(file), 0);
  {
    ProgressBar bar(4, "train", {.enabled = true, .stream = file, .min_interval_s = 0});
    for (int i = 0; i < 4; ++i) bar.update();
    bar.set_postfix("loss=1.0");
  }
  std::rewind(file);
  char buf[4096] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, file);
  const std::string out(buf, n);
  EXPECT_NE(out.find("4/4"), std::string::npos) << out;
  EXPECT_NE(out.find("loss=1.0]"), std::string::npos) << out;
  EXPECT_EQ(out.back(), '\n');
  std::fclose(file);
}

}  // namespace
