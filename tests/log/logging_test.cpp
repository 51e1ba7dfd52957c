#include "mixprec/log/logging.h"

#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using mixprec::log::Level;

// Python's repr of each value, from Python itself (the values passed exactly, in hex).
TEST(Logging, PythonReprIsPythons) {
  const std::vector<double> values = {
      0.1,   1e-5,   1e-4,    3.0,        1e16, 1.5e-5,    -0.0, 0.0,      1e15,     2.5e300,
      -7.25, 5e-324, 1.0 / 3, 123456.789, 1e22, 0.3 - 0.1, NAN,  INFINITY, -INFINITY};
  std::string hex;
  std::vector<std::string> ours;
  for (const double v : values) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "%a ", v);
    hex += buffer;
    ours.push_back(mixprec::log::python_repr(v));
  }
  const std::string python = mixprec::testing::run_command(
      c10::str(MIXPREC_PYTHON, " -c \"print(' '.join(repr(float.fromhex(h)) for h in '", hex,
               "'.split()))\""));
  EXPECT_EQ(c10::Join(" ", ours) + "\n", python);
}

TEST(Logging, LevelsByName) {
  EXPECT_EQ(mixprec::log::level_from_name("detail"), Level::kDebug);
  EXPECT_EQ(mixprec::log::level_from_name("debug"), Level::kDebug);
  EXPECT_EQ(mixprec::log::level_from_name("info"), Level::kInfo);
  EXPECT_EQ(mixprec::log::level_from_name("warning"), Level::kWarning);
  EXPECT_EQ(mixprec::log::level_from_name("error"), Level::kError);
  EXPECT_EQ(mixprec::log::level_from_name("critical"), Level::kCritical);
  EXPECT_EQ(
      mixprec::testing::error_of([] { mixprec::log::level_from_name("verbose"); }),
      "log level 'verbose' is not one of \"detail\", \"debug\", \"info\", \"warning\", \"error\", "
      "\"critical\"");
}

// Warnings reach LibTorch's handler from kWarning down; info messages go to stderr from kInfo
// down.
TEST(Logging, VerbosityGatesWarningsAndInfo) {
  mixprec::testing::VerbosityGuard guard;
  mixprec::log::set_verbosity(Level::kError);
  {
    mixprec::testing::CapturedWarnings warnings;
    MIXPREC_WARN("hidden ", 1);
    EXPECT_TRUE(warnings.messages.empty());
  }
  ::testing::internal::CaptureStderr();
  mixprec::log::info("hidden ", 2);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");

  mixprec::log::set_verbosity(Level::kWarning);
  {
    mixprec::testing::CapturedWarnings warnings;
    MIXPREC_WARN("shown ", 3);
    EXPECT_EQ(warnings.messages, std::vector<std::string>{"shown 3"});
  }
  ::testing::internal::CaptureStderr();
  mixprec::log::info("hidden ", 4);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");

  mixprec::log::set_verbosity(Level::kInfo);
  ::testing::internal::CaptureStderr();
  mixprec::log::info("shown ", 5);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "shown 5\n");
}

}  // namespace
