// Helpers shared by the test suites.
#pragma once

#include "mixprec/log/logging.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>

#include <sys/wait.h>
#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace mixprec::testing {

/// What `accelerate launch` exports would change the precision of every Accelerator and Trainer
/// the tests make: cleared as each test program starts (a test sets them itself).
inline const bool launcher_environment_cleared = [] {
  for (const char* name : {"ACCELERATE_MIXED_PRECISION", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                           "ACCELERATE_USE_CPU"})
    unsetenv(name);
  return true;
}();

/// Sets an environment variable for a scope, then unsets it.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

/// What tests/reference/NAME.py wrote into tests/reference/data/.
inline nlohmann::json load_reference(const std::string& file) {
  const std::string path = std::string(MIXPREC_REFERENCE_DIR) + "/" + file;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

/// Runs the passes of a random-sampler case of tests/reference/data_loader_order.py on `loader`
/// (a DataLoader or a prepared one): passes of 1, size - 1, size batches and whole ones, in the
/// script's order, each followed by a draw from torch's generator. Returns them as the script
/// stores them: {"passes": [[batch's values of `key`, ...], ...], "draws": [...]}.
template <typename Loader>
nlohmann::json random_sampler_passes(Loader& loader, const std::string& key) {
  const auto size = static_cast<int64_t>(loader.size());
  const std::vector<int64_t> takes{-1, 1, std::max<int64_t>(size - 1, 1), size, -1, -1};
  nlohmann::json passes = nlohmann::json::array(), draws = nlohmann::json::array();
  for (const int64_t take : takes) {
    nlohmann::json batches = nlohmann::json::array();
    for (const auto& batch : loader) {
      const at::Tensor values = batch.at(key).contiguous();
      batches.push_back(std::vector<int64_t>(values.template data_ptr<int64_t>(),
                                             values.template data_ptr<int64_t>() + values.numel()));
      if (take >= 0 && static_cast<int64_t>(batches.size()) == take) break;
    }
    passes.push_back(batches);
    draws.push_back(at::randint(0, int64_t{1} << 62, {1}, at::kLong).template item<int64_t>());
  }
  return {{"passes", passes}, {"draws", draws}};
}

/// Whether this build runs under AddressSanitizer (which keeps freed memory in quarantine).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif

/// Restores mixprec's verbosity (log::set_verbosity) when it goes, whatever the test set.
struct VerbosityGuard {
  mixprec::log::Level saved = mixprec::log::get_verbosity();
  ~VerbosityGuard() { mixprec::log::set_verbosity(saved); }
};

/// The message of every warning raised on this thread while it lives.
class CapturedWarnings : public c10::WarningHandler {
 public:
  CapturedWarnings() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

/// The message of the c10::Error that f throws, without the backtrace.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

/// How many complete ("X") events named `name` a Chrome trace file holds.
inline int trace_events_named(const std::filesystem::path& file, const std::string& name) {
  std::ifstream in(file);
  const auto trace = nlohmann::json::parse(in);
  int count = 0;
  for (const auto& event : trace.at("traceEvents"))
    count += event.value("name", "") == name && event.value("ph", "") == "X";
  return count;
}

/// The names of the LibTorch ops (RecordFunction's FUNCTION scope) that f runs on this thread,
/// in order.
inline std::vector<std::string> ops_run_by(const std::function<void()>& f) {
  static thread_local std::vector<std::string>* names = nullptr;  // the callback cannot capture
  std::vector<std::string> seen;
  names = &seen;
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn)
                                     -> std::unique_ptr<at::ObserverContext> {
        names->emplace_back(fn.name());
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION}));
  const auto remove = c10::make_scope_exit([&] {
    at::removeCallback(handle);
    names = nullptr;
  });
  f();
  return seen;
}

/// Runs a shell command and returns what it printed on stdout; `exit_code`,
/// when given, gets its exit status (-1 when it did not exit normally).
inline std::string run_command(const std::string& command, int* exit_code = nullptr) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return out;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) out.append(buffer, n);
  const int status = pclose(pipe);
  if (exit_code) *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

/// `python3 tests/reference/SCRIPT ARGS`, with the interpreter the build found.
inline std::string run_reference_script(const std::string& script_and_args) {
  return run_command(std::string(MIXPREC_PYTHON) + " " + MIXPREC_REFERENCE_DIR + "/../" +
                     script_and_args);
}

// The checkpoint-N folders of a Trainer's output_dir, sorted by name.
inline std::vector<std::string> checkpoint_names(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  if (std::filesystem::exists(dir))
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.path().filename().string().starts_with("checkpoint-"))
        names.push_back(entry.path().filename().string());
  std::ranges::sort(names);
  return names;
}

}  // namespace mixprec::testing
