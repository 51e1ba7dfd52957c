// `mixprec precision-report`: the same short training in fp32, bf16 and fp16
// (and pure bf16) from one seed, with the numerics monitor on; compares loss
// curves, the loss scale and how gradients fit fp16, recommends a precision
// and an init_scale, and writes report.md with PNG plots (drawn by gnuplot).
#include "cli/command.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/log/numerics_monitor.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

namespace mixprec::cli {

namespace {

namespace fs = std::filesystem;
using train::detail::json;

struct ReportArguments {
  std::string report_dir = "precision-report";
  /// "fp32" (the reference, required), "bf16", "fp16", "bf16-true" (pure bf16:
  /// parameters and AdamW states in bf16, stochastic rounding).
  std::vector<std::string> precisions = {"fp32", "bf16", "fp16", "bf16-true"};
  /// A precision whose final loss is within this share of fp32's does as well.
  double loss_tolerance = 0.02;

  std::vector<train::detail::Argument> arguments() {
    return {argument("report_dir", report_dir), argument("precisions", precisions),
            argument("loss_tolerance", loss_tolerance)};
  }
};

constexpr const char* kUsage =
    R"(usage: mixprec precision-report [--config FILE] [--name value ...]

Trains the model of `mixprec train` (same arguments) once per precision, from
the same seed (same initial weights, same batches), with the numerics monitor
on (numerics_monitor_steps, default 10), and writes report_dir/report.md with
PNG plots: loss per precision, the fp16 loss scale, gradient underflow per
tensor. It recommends a precision (bf16 mixed, else fp16, else fp32: the first
whose final loss is within loss_tolerance of fp32's) and an fp16 init_scale.
Keep max_steps small (the fp16 and fp32 runs are slow on CPUs without fast
fp16).

)";

struct Run {
  std::string precision;
  std::vector<std::pair<int64_t, double>> loss;  // (step, loss) at every step
  std::vector<log::ScalePoint> scales;
  std::vector<log::NumericsRecord> records;
  std::string summary;      // the monitor's
  double final_loss = NAN;  // mean of the last tenth of the steps
  double eval_loss = NAN;
  double samples_per_second = NAN;
  int64_t state_bytes = 0;  // parameters + AdamW's two moments
  std::string error;        // why the run stopped early, if it did
};

std::string fixed(double x, int digits = 4) {
  if (std::isnan(x)) return "–";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*g", digits, x);
  return buf;
}

std::string mebibytes(int64_t bytes) {
  double x = static_cast<double>(bytes);
  const char* unit = "B";
  for (const char* next : {"KiB", "MiB", "GiB"})
    if (x >= 1024) {
      x /= 1024;
      unit = next;
    }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3g %s", x, unit);
  return buf;
}

Run train_in(Command c, const std::string& precision, const fs::path& dir) {
  auto& a = c.training;
  a.fp16 = precision == "fp16";
  a.bf16 = precision == "bf16";
  a.output_dir = dir.string();
  a.overwrite_output_dir = true;
  a.logging_strategy = "steps";
  a.logging_steps = 1;
  a.eval_strategy = "no";
  a.save_strategy = "no";
  a.load_best_model_at_end = false;
  a.metric_for_best_model = std::nullopt;
  a.report_to = {"jsonl"};
  if (a.numerics_monitor_steps == 0) a.numerics_monitor_steps = 10;
  a.validate();
  torch::manual_seed(static_cast<uint64_t>(a.seed));
  Job job = make_job(c);
  if (precision == "bf16-true") job.module->to(torch::kBFloat16);

  Run run;
  run.precision = precision;
  for (const auto& p : job.module->parameters())
    run.state_bytes += 3 * p.numel() * static_cast<int64_t>(p.element_size());
  std::fprintf(stderr, "precision-report: training in %s\n", precision.c_str());
  auto trainer = job.make_trainer(a);
  try {
    const auto output = trainer->train();
    run.samples_per_second = output.metrics.at("train_samples_per_second");
    if (job.eval_samples > 0) run.eval_loss = trainer->evaluate().at("eval_loss");
  } catch (const c10::Error& e) {  // e.g. a NaN loss: the report says so
    run.error = e.what_without_backtrace();
  }
  for (const auto& entry : trainer->state().log_history)
    if (entry.count("loss"))
      run.loss.emplace_back(static_cast<int64_t>(entry.at("step")), entry.at("loss"));
  if (!run.loss.empty()) {
    const size_t n = std::max<size_t>(1, run.loss.size() / 10);
    double sum = 0;
    for (size_t i = run.loss.size() - n; i < run.loss.size(); ++i) sum += run.loss[i].second;
    run.final_loss = sum / static_cast<double>(n);
  }
  if (const auto* monitor = trainer->accelerator().numerics_monitor()) {
    run.scales = monitor->scale_history();
    run.records = monitor->records();
    run.summary = monitor->summary();
  }
  return run;
}

// Per tensor, the mean over inspected steps of the share of gradient elements
// that underflow, and the widest exponent range.
std::vector<std::pair<std::string, log::Fp16Range>> gradients_over_run(const Run& run) {
  std::vector<std::pair<std::string, log::Fp16Range>> total;
  for (const auto& record : run.records)
    for (const auto& [name, r] : record.gradients) {
      auto it =
          std::find_if(total.begin(), total.end(), [&](const auto& t) { return t.first == name; });
      if (it == total.end()) it = total.insert(total.end(), {name, {}});
      it->second.merge(r);
    }
  return total;
}

// The largest power of two that keeps the largest gradient seen below 2^15,
// half of fp16's range: room for gradients to double before an overflow.
int recommended_scale_exponent(const Run& fp32) {
  double max_exponent = NAN;
  for (const auto& [name, r] : gradients_over_run(fp32))
    max_exponent = std::fmax(max_exponent, r.max_exponent);
  if (std::isnan(max_exponent)) return 16;  // GradScaler's default
  return static_cast<int>(std::clamp(14.0 - max_exponent, 0.0, 24.0));
}

// Writes the plots' data and gnuplot script into `dir` and runs gnuplot
// where it is installed; returns the PNG files drawn.
std::vector<std::string> plot(const std::vector<Run>& runs, const Run& fp32, const fs::path& dir) {
  std::ofstream loss(dir / "loss.dat");
  loss << "# step";
  for (const auto& r : runs) loss << ' ' << r.precision;
  loss << '\n';
  std::map<int64_t, std::vector<double>> by_step;
  for (size_t i = 0; i < runs.size(); ++i)
    for (const auto& [step, value] : runs[i].loss) {
      auto& row = by_step[step];
      row.resize(runs.size(), NAN);
      row[i] = value;
    }
  for (auto& [step, row] : by_step) {
    row.resize(runs.size(), NAN);
    loss << step;
    for (double v : row) loss << ' ' << (std::isnan(v) ? std::string("NaN") : fixed(v, 8));
    loss << '\n';
  }
  loss.close();

  std::ostringstream gp;
  gp << "set terminal pngcairo size 960,540 noenhanced\nset grid\nset key outside right\n"
     << "set output 'loss.png'\nset title 'Training loss per precision (same seed, same batches)'\n"
     << "set xlabel 'step'\nset ylabel 'loss'\nplot ";
  for (size_t i = 0; i < runs.size(); ++i)
    gp << (i ? ", " : "") << "'loss.dat' using 1:" << i + 2 << " with lines lw 2 title '"
       << runs[i].precision << "'";
  gp << "\n";
  std::vector<std::string> drawn = {"loss.png"};

  const auto fp16 =
      std::find_if(runs.begin(), runs.end(), [](const Run& r) { return r.precision == "fp16"; });
  if (fp16 != runs.end() && !fp16->scales.empty()) {
    std::ofstream scale(dir / "loss_scale.dat");
    scale << "# step scale skipped\n";
    for (const auto& p : fp16->scales)
      scale << p.step << ' ' << p.scale << ' ' << p.skipped << '\n';
    gp << "set output 'loss_scale.png'\nset title 'fp16 loss scale (GradScaler)'\n"
       << "set ylabel 'scale'\nset logscale y 2\nset format y '2^%L'\n"
       << "plot 'loss_scale.dat' using 1:2 with steps lw 2 title 'scale after the step', "
       << "'' using 1:($3 > 0 ? $2 : 1/0) with points pt 7 ps 1.2 title 'skipped step'\n"
       << "unset logscale y\nset format y '%g'\n";
    drawn.push_back("loss_scale.png");
  }

  const auto grads = gradients_over_run(fp32);
  if (!grads.empty()) {
    std::ofstream under(dir / "underflow.dat");
    // Names without the prefix they all share ("transformer."), to fit the axis.
    size_t common = grads.front().first.size();
    for (const auto& [name, r] : grads)
      common = std::min(common, static_cast<size_t>(std::mismatch(name.begin(), name.end(),
                                                                  grads.front().first.begin(),
                                                                  grads.front().first.end())
                                                        .first -
                                                    name.begin()));
    common = grads.front().first.rfind('.', common) == std::string::npos
                 ? 0
                 : grads.front().first.rfind('.', common) + 1;
    under << "# tensor percent_underflow percent_subnormal (at scale 1)\n";
    for (const auto& [name, r] : grads)
      under << '"' << name.substr(std::min(common, name.size())) << "\" "
            << 100 * r.underflow_fraction() << ' ' << 100 * r.fraction(r.subnormal) << '\n';
    gp << "set output 'underflow.png'\n"
       << "set title 'fp32 run gradients in fp16 without loss scaling (scale 1)'\n"
       << "set xlabel ''\nset ylabel '% of the tensor'\nset yrange [0:*]\n"
       << "set key inside top right\nset style data histograms\n"
       << "set style histogram clustered\nset style fill solid 0.8\n"
       << "set xtics rotate by -60 font ',8'\n"
       << "plot 'underflow.dat' using 2:xtic(1) title 'flushed to zero', "
       << "'' using 3 title 'subnormal (precision lost)'\n";
    drawn.push_back("underflow.png");
  }
  std::ofstream(dir / "plots.gp") << gp.str();
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::fprintf(stderr,
                 "precision-report: gnuplot not found, so no PNG plots (apt-get install "
                 "gnuplot-nox); their data and script are in %s\n",
                 dir.c_str());
    return {};
  }
  std::string quoted = "'";  // for the shell: ' as '\''
  for (const char ch : dir.string())
    quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  quoted += "'";
  const std::string command = "cd " + quoted + " && gnuplot plots.gp > gnuplot.log 2>&1";
  if (std::system(command.c_str()) != 0) {  // the report itself is written all the same
    std::fprintf(stderr, "precision-report: gnuplot failed, so no PNG plots; see %s\n",
                 (dir / "gnuplot.log").c_str());
    return {};
  }
  return drawn;
}

// report.md, and report.json with the same figures.
std::pair<std::string, std::string> write_report(const Command& c, const ReportArguments& r,
                                                 const std::vector<Run>& runs,
                                                 const std::vector<std::string>& plots) {
  const Run& fp32 = runs.front();
  const auto& a = c.training;
  std::ostringstream md;
  md << "# Precision report\n\n"
     << "`mixprec precision-report`: " << c.model.model_type << ", "
     << (a.max_steps > 0 ? std::to_string(a.max_steps) + " steps"
                         : fixed(a.num_train_epochs) + " epochs")
     << " of batch " << a.per_device_train_batch_size << ", learning rate " << a.learning_rate
     << ", seed " << a.seed
     << "; every run starts from the same weights and sees the same batches. Final loss = mean "
        "training loss over the last tenth of the steps.\n\n";

  auto gap = [&](const Run& run) {
    return (run.final_loss - fp32.final_loss) / std::fabs(fp32.final_loss);
  };
  auto as_good = [&](const Run& run) {
    return run.error.empty() && std::isfinite(run.final_loss) &&
           std::fabs(gap(run)) <= r.loss_tolerance;
  };
  auto find = [&](const std::string& p) -> const Run* {
    for (const auto& run : runs)
      if (run.precision == p) return &run;
    return nullptr;
  };
  const int k = recommended_scale_exponent(fp32);
  md << "## Recommendation\n\n";
  const Run* bf16 = find("bf16");
  const Run* fp16 = find("fp16");
  const Run* pure = find("bf16-true");
  const std::string choice = bf16 && as_good(*bf16)   ? "bf16"
                             : fp16 && as_good(*fp16) ? "fp16"
                                                      : "fp32";
  char tol[32];
  std::snprintf(tol, sizeof(tol), "%.3g%%", 100 * r.loss_tolerance);
  if (choice == "bf16") {
    md << "**bf16 mixed precision** (`bf16: true`): its final loss is within " << tol
       << " of fp32's, with no loss scaling to tune.";
    if (pure && as_good(*pure))
      md << " Pure bf16 (parameters and AdamW states in bf16, stochastic rounding) is within "
         << tol << " too and halves the parameter + optimizer memory ("
         << mebibytes(pure->state_bytes) << " vs " << mebibytes(fp32.state_bytes) << ").";
    md << "\n\n";
  } else if (choice == "fp16") {
    md << "**fp16 mixed precision** (`fp16: true`) with GradScaler `init_scale = 2^" << k
       << "`: its final loss is within " << tol << " of fp32's" << (bf16 ? ", bf16's is not" : "")
       << ".\n\n";
  } else {
    md << "**fp32**: no 16-bit run ended within " << tol << " of fp32's final loss.\n\n";
  }
  md << "For fp16, `init_scale = 2^" << k
     << "`: the largest power of two that keeps the largest gradient the fp32 run saw below 2^15 "
        "(half of fp16's range, room to grow before an overflow).";
  if (fp16 && !fp16->scales.empty())
    md << " The fp16 run's dynamic scale ended at " << log::power_of_two(fp16->scales.back().scale)
       << ".";
  md << "\n\n## Runs\n\n"
     << "| precision | final loss | vs fp32 | eval loss | samples/s | skipped steps | loss scale "
        "at end "
        "| parameters + AdamW states |\n|---|---|---|---|---|---|---|---|\n";
  for (const auto& run : runs) {
    int64_t skipped = 0;
    for (const auto& p : run.scales) skipped += p.skipped;
    char rel[32];
    std::snprintf(rel, sizeof(rel), "%+.2f%%", 100 * gap(run));
    md << "| " << run.precision << " | " << fixed(run.final_loss) << " | "
       << (&run == &fp32 ? "–" : rel) << " | " << fixed(run.eval_loss) << " | "
       << fixed(run.samples_per_second, run.samples_per_second >= 1000 ? 6 : 3) << " | "
       << (run.precision == "fp16" ? std::to_string(skipped) : "–") << " | "
       << (run.precision == "fp16" && !run.scales.empty()
               ? log::power_of_two(run.scales.back().scale)
               : "–")
       << " | " << mebibytes(run.state_bytes) << " |\n";
  }
  for (const auto& run : runs)
    if (!run.error.empty())
      md << "\n**" << run.precision << " stopped early:** " << run.error << "\n";
  md << "\n";
  auto image = [&](const std::string& file, const std::string& alt) {
    if (std::find(plots.begin(), plots.end(), file) != plots.end())
      md << "![" << alt << "](" << file << ")\n\n";
  };
  image("loss.png", "loss per precision");
  if (fp16) {
    md << "## fp16 loss scale\n\n";
    image("loss_scale.png", "fp16 loss scale");
  }
  md << "## Gradients in fp16's range\n\n"
     << "The fp32 run's gradients, checked against fp16 at scale 1 (fp16 without loss scaling) at "
        "each inspected step; the share that would flush to zero, averaged over those steps:\n\n";
  image("underflow.png", "gradient underflow per tensor");
  auto grads = gradients_over_run(fp32);
  std::stable_sort(grads.begin(), grads.end(), [](const auto& x, const auto& y) {
    return x.second.underflow_fraction() > y.second.underflow_fraction();
  });
  md << "| tensor | underflow at scale 1 | subnormal | exponents (2^min .. 2^max) "
        "|\n|---|---|---|---|\n";
  for (const auto& [name, g] : grads)
    md << "| " << name << " | " << fixed(100 * g.underflow_fraction(), 3) << "% | "
       << fixed(100 * g.fraction(g.subnormal), 3) << "% | " << fixed(g.min_exponent) << " .. "
       << fixed(g.max_exponent) << " |\n";
  md << "\n## Numerics monitor summaries\n\n";
  for (const auto& run : runs)
    md << "### " << run.precision << "\n\n```text\n" << run.summary << "```\n\n";

  // The same figures for programs.
  json figures = {
      {"recommendation", choice}, {"init_scale", std::ldexp(1.0, k)}, {"runs", json::array()}};
  for (const auto& run : runs) {
    json j = {{"precision", run.precision},
              {"state_bytes", run.state_bytes},
              {"steps", run.scales.size()},
              {"inspected_steps", run.records.size()}};
    auto number = [&](const char* key, double v) {
      j[key] = std::isfinite(v) ? json(v) : json(nullptr);
    };
    number("final_loss", run.final_loss);
    number("eval_loss", run.eval_loss);
    number("samples_per_second", run.samples_per_second);
    int64_t skipped = 0;
    for (const auto& p : run.scales) skipped += p.skipped;
    j["skipped_steps"] = skipped;
    if (!run.scales.empty()) j["final_scale"] = run.scales.back().scale;
    if (!run.error.empty()) j["error"] = run.error;
    figures["runs"].push_back(j);
  }
  return {md.str(), figures.dump(2) + "\n"};
}

}  // namespace

int precision_report(Command& c, const std::vector<std::string>& words) {
  ReportArguments report;
  auto parser = c.parser("mixprec precision-report");
  parser.add_group("Report arguments", report.arguments());
  if (std::find(words.begin(), words.end(), "--help") != words.end() ||
      std::find(words.begin(), words.end(), "-h") != words.end()) {
    std::cout << kUsage << parser.help();
    return 0;
  }
  parser.parse_args(words);
  TORCH_CHECK(!report.precisions.empty() && report.precisions.front() == "fp32",
              "mixprec precision-report: precisions must start with fp32 (the reference), got '",
              report.precisions.empty() ? "" : report.precisions.front(), "'");
  for (const auto& p : report.precisions)
    TORCH_CHECK(p == "fp32" || p == "bf16" || p == "fp16" || p == "bf16-true",
                "mixprec precision-report: unknown precision '", p,
                "'; expected fp32, bf16, fp16 or bf16-true");
  TORCH_CHECK(report.loss_tolerance > 0,
              "mixprec precision-report: loss_tolerance must be > 0, got ", report.loss_tolerance);
  // Each run sets its own precision: the fp32 and pure bf16 runs, which set neither fp16 nor
  // bf16, must not take the launcher's (`accelerate launch` exports it).
  unsetenv("ACCELERATE_MIXED_PRECISION");
  const fs::path dir = report.report_dir;
  fs::create_directories(dir);
  std::vector<Run> runs;
  for (const auto& p : report.precisions) runs.push_back(train_in(c, p, dir / p));
  const std::vector<std::string> plots = plot(runs, runs.front(), dir);
  const auto [markdown, figures] = write_report(c, report, runs, plots);
  io::write_file_atomically(dir / "report.md", markdown);
  io::write_file_atomically(dir / "report.json", figures);
  std::printf("precision-report: %s\n", (dir / "report.md").c_str());
  return 0;
}

}  // namespace mixprec::cli
