#include "mixprec/log/progress.h"

#include <unistd.h>

#include <cmath>

namespace mixprec::log {

namespace {

// 00:42, 12:03, 1:02:03 as tqdm writes durations.
std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds >= 9e18) return "?";  // int64's range
  const auto s = static_cast<int64_t>(seconds);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof(buf), "%02lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  return buf;
}

}  // namespace

ProgressBar::ProgressBar(int64_t total, std::string description, ProgressOptions options)
    : total_(total),
      description_(std::move(description)),
      options_(options),
      enabled_(options.enabled.value_or(isatty(fileno(options.stream)) != 0)),
      start_(Clock::now()),
      last_draw_(start_) {
  if (enabled_) draw();
}

ProgressBar::~ProgressBar() { close(); }

void ProgressBar::update(int64_t n) {
  done_ += n;
  if (!enabled_) return;
  const auto now = Clock::now();
  if (done_ >= total_ ||
      std::chrono::duration<double>(now - last_draw_).count() >= options_.min_interval_s) {
    last_draw_ = now;
    draw();
  }
}

void ProgressBar::set_postfix(std::string postfix) { postfix_ = std::move(postfix); }

void ProgressBar::close() {
  if (closed_) return;
  closed_ = true;
  if (!enabled_) return;
  draw();
  std::fputc('\n', options_.stream);
  std::fflush(options_.stream);
}

void ProgressBar::draw() {
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const std::string line = format(description_, done_, total_, elapsed, postfix_);
  std::fprintf(options_.stream, "\r%s\x1b[K", line.c_str());  // \x1b[K clears what was longer
  std::fflush(options_.stream);
}

std::string ProgressBar::format(const std::string& description, int64_t done, int64_t total,
                                double elapsed_s, const std::string& postfix, int bar_width) {
  const double fraction = total > 0 ? std::min(1.0, static_cast<double>(done) / total) : 0.0;
  // Eighths of a cell, as tqdm draws them.
  static const char* const kEighths[] = {"", "▏", "▎", "▍", "▌", "▋", "▊", "▉"};
  const int eighths = static_cast<int>(fraction * bar_width * 8);
  std::string bar;
  for (int i = 0; i < eighths / 8; ++i) bar += "█";
  int cells = eighths / 8;
  if (cells < bar_width && eighths % 8) {
    bar += kEighths[eighths % 8];
    ++cells;
  }
  bar.append(static_cast<size_t>(bar_width - cells), ' ');
  // As tqdm: no rate yet (nothing done, or no time passed) is "?", below 1 it/s it inverts.
  const double rate = elapsed_s > 0 ? done / elapsed_s : 0.0;
  const double remaining = rate > 0 ? (total - done) / rate : NAN;
  char rate_text[32];
  if (rate == 0)
    std::snprintf(rate_text, sizeof(rate_text), "?it/s");
  else if (rate < 1)
    std::snprintf(rate_text, sizeof(rate_text), "%5.2fs/it", 1 / rate);
  else
    std::snprintf(rate_text, sizeof(rate_text), "%5.2fit/s", rate);
  char head[64];
  std::snprintf(head, sizeof(head), "%3.0f%%|", 100 * fraction);
  std::string line = description.empty() ? "" : description + ": ";
  line += head + bar + "| " + std::to_string(done) + "/" + std::to_string(total) + " [" +
          clock_text(elapsed_s) + "<" + clock_text(remaining) + ", " + rate_text;
  if (!postfix.empty()) line += ", " + postfix;
  return line + "]";
}

}  // namespace mixprec::log
