#include "mixprec/log/progress.h"

#include "test_util.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace {

using mixprec::log::ProgressBar;

// Each line as tqdm's format_meter draws it (tests/reference/tqdm_format.py).
TEST(ProgressBar, FormatsLikeTqdm) {
  const auto reference = mixprec::testing::load_reference("tqdm_format.json");
  for (const auto& c : reference.at("cases"))
    EXPECT_EQ(ProgressBar::format(c.at("description"), c.at("done"), c.at("total"), c.at("elapsed"),
                                  c.at("postfix")),
              c.at("line").get<std::string>());
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
