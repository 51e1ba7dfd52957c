#!/usr/bin/env python3
"""The benchmark driver: runs the level-1 loop, the Accelerator loop and the Trainer in C++
(mixprec) and in Python (PyTorch, HF Accelerate, HF Trainer) side by side, interleaved,
several times, and prints Markdown tables of medians.

    python3 bench/run.py [--reps 5] [--steps 300] [--build build] [--json out.json] [--plot out.png]
    python3 bench/run.py --workload gpt2-small|gpt2-large [--reps 3] [--steps N] [--timeout 600]
    python3 bench/run.py --workload dp [--reps 3] [--steps 20] [--losses dp_losses.jsonl]

Tables: steps/s per precision (fused AdamW; GradScaler for fp16) of each level on the
digits classifier, ratio of mixprec to its Python twin, the Accelerator's and the
Trainer's overhead over the plain loop, and the final losses; and the GradScaler's own
cost in fp16, as a share of step time: 1 - (steps/s with the scaler) / (steps/s without it), for the
fused and the unfused AdamW. Overheads and costs are ratios of runs made back to back, the median
over the reps.

With --workload gpt2-small or gpt2-large: the level-1 loop on GPT-2
(bench/gpt2_bench.cpp and its twin bench/gpt2_bench.py on transformers), fresh
init, synthetic tokens, B 8, V 4096; small = 2 layers x 128, 4 heads, T 128;
large = 6 layers x 512, 8 heads, T 256. Tokens/s over --steps steps after 2
warm-up steps (default 20 small, 5 large), and each run's peak RSS
(getrusage ru_maxrss in the child); mixprec's fp16 with its CPU fast path
forced on and off; the same loop through mixprec's Accelerator and HF
Accelerate (--level accelerator) and through the two Trainers (--level
trainer), for their overhead; MFU against the GEMM
peak of each dtype, measured in the same run (a 1024^3 GEMM, interleaved with
the reps). A run past --timeout seconds is reported as "timed out" and not
tried again.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (loop, precision, optimizer, scaler)
CONFIGS = [
    ("plain", "fp32", "fused", False),
    ("plain", "bf16", "fused", False),
    ("plain", "fp16", "fused", True),
    ("accelerator", "fp32", "fused", False),
    ("accelerator", "bf16", "fused", False),
    ("accelerator", "fp16", "fused", True),
    ("trainer", "fp32", "fused", False),
    ("trainer", "bf16", "fused", False),
    ("trainer", "fp16", "fused", True),
    ("plain", "fp16", "fused", False),
    ("plain", "fp16", "unfused", True),
    ("plain", "fp16", "unfused", False),
]


def run_one(impl, config, args):
    loop, precision, optimizer, scaler = config
    flags = ["--loop", loop, "--precision", precision, "--optimizer", optimizer, "--steps", str(args.steps),
             "--data", args.data]
    if scaler:
        flags.append("--scaler")
    if impl == "mixprec":
        cmd = [os.path.join(args.build, "bench", "amp_loop_bench")] + flags
    else:
        cmd = [sys.executable, os.path.join(ROOT, "bench", "amp_loop_bench.py")] + flags
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# (impl, precision, fast path, level) of the GPT-2 workload; PyTorch has no
# fast path; level "accelerator" is mixprec's Accelerator or HF Accelerate's,
# "trainer" mixprec's Trainer or transformers'. A precision's configurations
# run back to back within a rep, so that the ratios between them (mixprec /
# PyTorch, the overheads) are taken where the machine's drift is least.
GPT2_CONFIGS = [
    ("mixprec", "fp32", None, "loop"),
    ("pytorch", "fp32", None, "loop"),
    ("mixprec", "fp32", None, "accelerator"),
    ("pytorch", "fp32", None, "accelerator"),
    ("mixprec", "fp32", None, "trainer"),
    ("pytorch", "fp32", None, "trainer"),
    ("mixprec", "bf16", None, "loop"),
    ("pytorch", "bf16", None, "loop"),
    ("mixprec", "bf16", None, "accelerator"),
    ("pytorch", "bf16", None, "accelerator"),
    ("mixprec", "bf16", None, "trainer"),
    ("pytorch", "bf16", None, "trainer"),
    ("mixprec", "fp16", "on", "loop"),
    ("mixprec", "fp16", "off", "loop"),
    ("pytorch", "fp16", None, "loop"),
    ("mixprec", "fp16", None, "accelerator"),
    ("pytorch", "fp16", None, "accelerator"),
    ("mixprec", "fp16", None, "trainer"),
    ("pytorch", "fp16", None, "trainer"),
    ("mixprec", "bf16-pure", None, "loop"),
    ("pytorch", "bf16-pure", None, "loop"),
]


# glibc settings that keep freed memory for reuse (what mixprec's Accelerator and Trainer set with
# mallopt); --malloc-reuse gives them to every GPT-2 run, C++ and Python alike.
MALLOC_REUSE = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def gemm_peaks(reps=5, n=1024):
    """GFLOP/s of a 1024^3 GEMM per dtype on this machine now (median of reps), 2 threads: the
    MFU denominator, measured in the same run as the tokens/s. fp32 takes the faster of
    torch.mm (MKL) and oneDNN's linear, which mixprec's fp32 linear layers run."""
    import time

    import torch
    torch.set_num_threads(2)
    linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        gemms = [lambda: torch.mm(a, b)]
        if name == "fp32" and linear is not None:
            gemms.append(lambda: linear(a, b, None, "none", [], ""))
        best = 0.0
        for gemm in gemms:
            gemm()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                gemm()
                times.append(time.perf_counter() - start)
            best = max(best, 2 * n ** 3 / statistics.median(times) / 1e9)
        peaks[name] = best
    return peaks


def flops_per_token(size):
    """Training FLOPs per token of the GPT-2 workload, PaLM's count: 6 x (matmul
    parameters: 12 d^2 per layer + the tied LM head V d) + 12 L T d (attention)."""
    layers, d, t, v = (6, 512, 256, 4096) if size == "large" else (2, 128, 128, 4096)
    return 6 * (12 * layers * d * d + v * d) + 12 * layers * t * d


def run_gpt2(config, size, args):
    impl, precision, fast_path, level = config
    flags = ["--size", size, "--precision", precision, "--steps", str(args.steps), "--level", level]
    if impl == "mixprec":
        cmd = [os.path.join(args.build, "bench", "gpt2_bench")] + flags + ["--fast-path", fast_path or "auto"]
    else:
        cmd = [sys.executable, os.path.join(ROOT, "bench", "gpt2_bench.py")] + flags
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.timeout,
                             env=dict(os.environ, **MALLOC_REUSE) if args.malloc_reuse else None).stdout
    except subprocess.TimeoutExpired:
        return None
    r = json.loads(out.strip().splitlines()[-1])
    if fast_path is not None:  # the fast path was (not) taken as asked
        assert (r["fast_path_calls"] > 0) == (fast_path == "on"), r
    return r


def gpt2_config_of(r):
    return (r["impl"], r["precision"], None if r["impl"] == "pytorch" or r["fast_path"] == "auto" else r["fast_path"],
            r.get("level", "loop"))


def main_gpt2(args):
    size = args.workload.split("-")[1]
    if args.steps is None:
        args.steps = 20 if size == "small" else 5
    runs, timed_out, peaks = {}, set(), {}
    if args.from_json:  # print the tables of an earlier run
        with open(args.from_json) as f:
            saved = json.load(f)
        args.steps, args.reps = saved["steps"], saved["reps"]
        args.malloc_reuse = saved.get("malloc_reuse", False)
        args.timeout = saved.get("timeout", args.timeout)
        timed_out = {tuple(c) for c in saved["timed_out"]}
        peaks = saved.get("gemm_peaks", {})
        for r in saved["runs"]:
            runs.setdefault(gpt2_config_of(r), []).append(r)
    levels, impls = args.levels.split(","), args.impls.split(",")
    for rep in range(0 if args.from_json else args.reps):
        for config in GPT2_CONFIGS:
            if config in timed_out or config[3] not in levels or config[0] not in impls:
                continue
            r = run_gpt2(config, size, args)
            if r is None:
                timed_out.add(config)
            else:
                runs.setdefault(config, []).append(r)
        for dtype, gflops in gemm_peaks().items():  # interleaved too
            peaks.setdefault(dtype, []).append(gflops)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)

    def median(config, key="tokens_per_s", pick=statistics.median):
        if config in timed_out or config not in runs:
            return None
        values = [r[key] for r in runs[config] if key in r]  # older files lack activation_mb
        return pick(values) if values else None

    def cell(v, fmt="{:.0f}"):  # None: not run, or timed out (listed after the tables)
        return "-" if v is None else fmt.format(v)

    def paired(a, b, key="tokens_per_s"):  # median over the reps of a's value / b's, each pair from one rep
        if median(a, key) is None or median(b, key) is None:
            return None
        return statistics.median(x[key] / y[key] for x, y in zip(runs[a], runs[b]) if key in x and key in y)

    import torch
    shape = {"small": "2 layers x 128, 4 heads, T 128", "large": "6 layers x 512, 8 heads, T 256"}[size]
    print(f"GPT-2 {size} ({shape}, B 8, V 4096), level-1 loop, fused AdamW, {args.steps} timed steps after 2 "
          f"warm-up, median of {args.reps} interleaved runs (ratios: median of the ratios within a rep); {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, 2 threads"
          + ("; every process with " + " ".join(f"{k}={v}" for k, v in MALLOC_REUSE.items()) if args.malloc_reuse
             else "") + ".\n")
    peak = {dtype: statistics.median(v) for dtype, v in peaks.items()}

    def mfu(config):  # fp16: the fast path runs fp32 GEMMs, and without FP16 arithmetic LibTorch's
        v = median(config)  # fp16 mm is a scalar loop, no peak: the higher of the two
        dtype = config[1].removesuffix("-pure")
        if v is None or dtype not in peak:
            return "-"
        best = max(peak[dtype], peak.get("fp32", 0.0)) if dtype == "fp16" else peak[dtype]
        return f"{100 * v * flops_per_token(size) / 1e9 / best:.0f}%"

    print("| precision | mixprec tokens/s | PyTorch tokens/s | mixprec / PyTorch | best run: mixprec / PyTorch "
          "| peak RSS MB: mixprec / PyTorch | activations MB: mixprec / PyTorch | MFU: mixprec / PyTorch |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [("fp32", ("mixprec", "fp32", None, "loop"), ("pytorch", "fp32", None, "loop")),
            ("bf16", ("mixprec", "bf16", None, "loop"), ("pytorch", "bf16", None, "loop")),
            ("fp16 + GradScaler, mixprec fast path on", ("mixprec", "fp16", "on", "loop"),
             ("pytorch", "fp16", None, "loop")),
            ("fp16 + GradScaler, fast path off (LibTorch's fp16 kernels)", ("mixprec", "fp16", "off", "loop"),
             ("pytorch", "fp16", None, "loop")),
            ("pure bf16 (model in bf16, no autocast; AdamW: mixprec stochastic rounding, PyTorch fused)",
             ("mixprec", "bf16-pure", None, "loop"), ("pytorch", "bf16-pure", None, "loop"))]
    for name, m, t in rows:
        mv, tv = median(m), median(t)
        print(f"| {name} | {cell(mv)} | {cell(tv)} | {cell(paired(m, t), '{:.2f}x')} | {cell(median(m, pick=max))} / "
              f"{cell(median(t, pick=max))} | {cell(median(m, 'peak_rss_mb'))} / {cell(median(t, 'peak_rss_mb'))} "
              f"| {cell(median(m, 'activation_mb'))} / {cell(median(t, 'activation_mb'))} | {mfu(m)} / {mfu(t)} |")
    print("\nActivations: what one forward leaves allocated for the backward (saved tensors, autocast's 16-bit "
          "weight copies), from the profiler's memory events; peak RSS: the whole process (ru_maxrss).")
    print(f"\nMFU = tokens/s x {flops_per_token(size) / 1e6:.1f} MFLOP/token (6 x matmul parameters + 12 L T d) / "
          "the GEMM peak measured in this run (1024^3; fp32: the faster of torch.mm and oneDNN's linear; median): "
          + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items()) + "; fp16 runs against the higher of "
          "the fp16 and fp32 peaks.")

    print("\n| precision | mixprec loop | Accelerator | Trainer | overhead: Accelerator / Trainer "
          "| PyTorch loop | HF Accelerate | HF Trainer | overhead: Accelerate / HF Trainer |")
    print("|---|---|---|---|---|---|---|---|---|")
    def over(loop, level):
        ratio = paired(loop, level)
        return "-" if ratio is None else f"{100 * (ratio - 1):+.1f}%"

    for precision in ("fp32", "bf16", "fp16"):
        loop = ("mixprec", precision, None, "loop")
        if precision == "fp16":  # the loop run whose fast path is kAuto's, as the Accelerator and Trainer run
            active = any(r["fast_path_active"] for key, rs in runs.items()
                         if key[0] == "mixprec" and key[2] is None for r in rs)
            loop = ("mixprec", "fp16", "on" if active else "off", "loop")
        m = [loop] + [("mixprec", precision, None, level) for level in ("accelerator", "trainer")]
        t = [("pytorch", precision, None, level) for level in ("loop", "accelerator", "trainer")]
        print(f"| {precision} | {' | '.join(cell(median(c)) for c in m)} | {over(m[0], m[1])} / {over(m[0], m[2])} "
              f"| {' | '.join(cell(median(c)) for c in t)} | {over(t[0], t[1])} / {over(t[0], t[2])} |")
    print("\nOverhead = loop tokens/s / (Accelerator or Trainer) tokens/s - 1, the median of its ratios within a "
          "rep (as the mixprec / PyTorch column). The Trainers clip gradients at 1 "
          "(HF's default) and shuffle; the loops do neither. HF Accelerate and the HF Trainer on a CPU train fp16 in "
          "fp32 (their final losses equal their fp32 runs'); mixprec's run fp16 autocast + GradScaler.")

    def ratio(a, b, key="tokens_per_s"):
        return cell(paired(a, b, key), "{:.2f}")

    print(f"\nfp16 / fp32 tokens/s (medians of the ratios within a rep): mixprec fast path on "
          f"{ratio(('mixprec', 'fp16', 'on', 'loop'), ('mixprec', 'fp32', None, 'loop'))}"
          f", fast path off {ratio(('mixprec', 'fp16', 'off', 'loop'), ('mixprec', 'fp32', None, 'loop'))}"
          f", PyTorch {ratio(('pytorch', 'fp16', None, 'loop'), ('pytorch', 'fp32', None, 'loop'))}.")
    print()
    for impl in ("mixprec", "pytorch"):
        fp16 = ("mixprec", "fp16", "on", "loop") if impl == "mixprec" else ("pytorch", "fp16", None, "loop")
        rss = lambda config: ratio(config, (impl, "fp32", None, "loop"), "peak_rss_mb")
        print(f"Peak RSS / fp32's, {impl} loop (medians of the ratios within a rep): bf16 mixed {rss((impl, 'bf16', None, 'loop'))}, "
              f"fp16 mixed {rss(fp16)}, pure bf16 {rss((impl, 'bf16-pure', None, 'loop'))}.")
    if timed_out:
        print(f"\nTimed out (> {args.timeout:.0f} s), shown as -: "
              + ", ".join(" ".join(str(c) for c in config if c) for config in sorted(timed_out, key=str)) + ".")
    if args.plot:
        plot_gpt2(args.plot, size, median, ", every process with malloc reuse" if args.malloc_reuse else "")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "steps": args.steps, "reps": args.reps, "timeout": args.timeout,
                       "gemm_peaks": peaks,
                       "malloc_reuse": args.malloc_reuse,
                       "timed_out": sorted(timed_out, key=str), "runs": [r for rs in runs.values() for r in rs]},
                      f, indent=1)


# mixprec's three levels beside their Python twins: (impl, level, title, colour).
PLOT_COLUMNS = [("mixprec", "loop", "mixprec loop", "#1f4e9c"), ("pytorch", "loop", "PyTorch loop", "#b34d00"),
                ("mixprec", "accelerator", "mixprec Accelerator", "#4f81d4"),
                ("pytorch", "accelerator", "HF Accelerate", "#e6862e"),
                ("mixprec", "trainer", "mixprec Trainer", "#9bbcf0"), ("pytorch", "trainer", "HF Trainer", "#f5c08a")]


def plot_gpt2(path, size, median, note=""):
    """Tokens/s medians by precision, mixprec's three levels beside their Python twins."""
    rows = [("fp32", "fp32", None), ("bf16", "bf16", None), ("fp16 (fast path on)", "fp16", "on"),
            ("fp16", "fp16", "off"), ("pure bf16", "bf16-pure", None)]

    def value(impl, level, precision, fast_path):
        if precision == "fp16" and (impl, level) == ("mixprec", "loop"):
            return median((impl, precision, fast_path or "off", level))
        if fast_path == "on":
            return None  # only mixprec's loop runs with the fast path forced on
        return median((impl, precision, None, level))

    table = [[value(impl, level, precision, fast_path) for impl, level, _, _ in PLOT_COLUMNS]
             for _, precision, fast_path in rows]
    plot_bars(path, f"GPT-2 {size}: tokens/s (median{note}), higher is better", "tokens/s",
              [name for name, _, _ in rows], table)


def plot_bars(path, title, ylabel, row_names, table):
    """Grouped bars, one group per row, one bar per PLOT_COLUMNS entry (gnuplot, installed by
    scripts/setup; its data and script are kept beside the PNG). None: not run."""
    keep = [i for i in range(len(PLOT_COLUMNS)) if any(row[i] is not None for row in table)]  # gnuplot
    columns = [PLOT_COLUMNS[i] for i in keep]  # rejects a column without points
    base = os.path.splitext(path)[0]
    with open(base + ".dat", "w") as f:
        f.write("precision " + " ".join(f'"{title}"' for _, _, title, _ in columns) + "\n")
        for name, row in zip(row_names, table):
            f.write(f'"{name}" ' + " ".join("NaN" if row[i] is None else f"{row[i]:.0f}" for i in keep) + "\n")
    with open(base + ".gp", "w") as f:
        f.write(f"""set terminal pngcairo size 1000,480 noenhanced
set output '{path}'
set title '{title}'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set key outside right top vertical
set ylabel '{ylabel}'
set yrange [0:*]
set grid ytics
colors = "{' '.join(color for *_, color in columns)}"
plot for [i=2:{len(columns) + 1}] '{base}.dat' using i:xtic(1) title columnheader(i) lc rgb word(colors, i-1)
""")
    try:
        subprocess.run(["gnuplot", base + ".gp"], check=True)
        print(f"\nPlot: {path} (data {base}.dat, script {base}.gp)")
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"\nNo plot ({e}); its data and script: {base}.dat, {base}.gp (apt-get install gnuplot-nox)")


# (processes, compression) of the data-parallel workload.
DP_CONFIGS = [(1, "none"), (2, "none"), (2, "fp16"), (2, "bf16")]


def run_dp(config, args):
    processes, compression = config
    cmd = [os.path.join(args.build, "bench", "dp_bench"), "--compression", compression, "--steps", str(args.steps),
           "--threads", "1"]
    if processes > 1:  # --standalone: a free port, not torchrun's default 29500
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "--no-python"] + cmd
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.timeout).stdout
    return json.loads(out.strip().splitlines()[-1])


def main_dp(args):
    if args.steps is None:
        args.steps = 20
    runs = {}
    for rep in range(args.reps):
        for config in DP_CONFIGS:
            runs.setdefault(config, []).append(run_dp(config, args))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)

    def median(config, key):
        return statistics.median(r[key] for r in runs[config])

    import torch
    one = median((1, "none"), "tokens_per_s")
    reference = runs[(2, "none")][0]["losses"]
    print(f"Data parallel, GPT-2 small (2 layers x 128, 4 heads, T 128, B 8 per process, V 4096), fp32, fused "
          f"AdamW, {args.steps} timed steps after 2 warm-up, 1 thread per process, Gloo, median of {args.reps} "
          f"interleaved runs; {platform.processor() or platform.machine()}, torch {torch.__version__}.\n")
    print("| processes | all-reduce in | tokens/s (global) | scaling efficiency | bytes all-reduced per step "
          "| final loss | max loss difference from fp32 all-reduce |")
    print("|---|---|---|---|---|---|---|")
    for config in DP_CONFIGS:
        processes, compression = config
        tps = median(config, "tokens_per_s")
        efficiency = "-" if processes == 1 else f"{tps / (processes * one):.2f}"
        dtype = "-" if processes == 1 else {"none": "fp32", "fp16": "fp16", "bf16": "bf16"}[compression]
        r = runs[config][0]
        diff = "-" if processes == 1 else f"{max(abs(a - b) for a, b in zip(r['losses'], reference)):.2e}"
        print(f"| {processes} | {dtype} | {tps:.0f} | {efficiency} | {median(config, 'bytes_per_step'):,.0f} "
              f"| {r['final_loss']:.4f} | {diff} |")
    with open(args.losses, "w") as f:
        for (processes, compression), rs in runs.items():
            for rep, r in enumerate(rs):
                for step, loss in enumerate(r["losses"]):
                    f.write(json.dumps({"processes": processes, "compression": compression, "rep": rep,
                                        "step": step, "loss": loss}) + "\n")
    print(f"\nLoss per step of every run: {args.losses}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r for rs in runs.values() for r in rs], f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["digits", "gpt2-small", "gpt2-large", "dp"], default="digits")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, help="timed steps per run (default 300 digits, 20 gpt2-small and dp, 5 gpt2-large)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per GPT-2 or dp run")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "digits.csv"))
    p.add_argument("--json", help="also write every run here")
    p.add_argument("--levels", default="loop,accelerator,trainer",
                   help="GPT-2 workloads: which levels to run (comma-separated)")
    p.add_argument("--impls", default="mixprec,pytorch",
                   help="GPT-2 workloads: whose runs (comma-separated): mixprec's, PyTorch's twins'")
    p.add_argument("--malloc-reuse", action="store_true",
                   help="GPT-2 workloads: run every process (C++ and Python) with glibc keeping freed memory "
                        "for reuse, as mixprec's Accelerator and Trainer do by themselves")
    p.add_argument("--plot", help="digits and GPT-2 workloads: also draw the medians into this PNG (gnuplot)")
    p.add_argument("--losses", default="dp_losses.jsonl", help="dp: the loss curves, one JSON line per step")
    p.add_argument("--from-json", help="GPT-2 workloads: print the tables of a file --json wrote, run nothing")
    args = p.parse_args()
    if args.from_json and not args.workload.startswith("gpt2"):
        p.error(f"--from-json reads the files of GPT-2 workloads only (got --workload {args.workload})")
    if args.workload == "dp":
        return main_dp(args)
    if args.workload != "digits":
        return main_gpt2(args)
    if args.steps is None:
        args.steps = 300

    # One implementation's runs of one precision back to back, so that the ratios between them
    # (overheads, the GradScaler's cost) are taken within a rep, where the machine's drift is least.
    runs = {}
    for rep in range(args.reps):
        for precision in ("fp32", "bf16", "fp16"):
            for impl in ("mixprec", "pytorch"):
                for config in (c for c in CONFIGS if c[1] == precision):
                    r = run_one(impl, config, args)
                    runs.setdefault((impl,) + config, []).append(r)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)

    def median(impl, config):
        return statistics.median(r["steps_per_s"] for r in runs[(impl,) + config])

    def paired(impl, a, b):  # median over the reps of a's steps/s / b's, each pair from one rep
        return statistics.median(x["steps_per_s"] / y["steps_per_s"]
                                 for x, y in zip(runs[(impl,) + a], runs[(impl,) + b]))

    def loss(impl, config):
        return runs[(impl,) + config][0]["final_loss"]

    import torch
    print(f"Level-1 loop, Accelerator loop and Trainer, digits MLP (64-256-256-10, batch 64), {args.steps} timed "
          f"steps after 30 warm-up, median of {args.reps} interleaved runs; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 2 threads. Steps/s.\n")
    print("| precision | loop: mixprec | PyTorch | ratio | Accelerator: mixprec | Accelerate | ratio "
          "| Trainer: mixprec | HF Trainer | ratio | overhead over the loop: Accelerator / Trainer (mixprec) "
          "| final loss: loop / Accelerator / Accelerate | mean training loss: Trainer / HF Trainer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for precision, scaler in (("fp32", False), ("bf16", False), ("fp16", True)):
        plain, acc, trainer = ((loop, precision, "fused", scaler) for loop in ("plain", "accelerator", "trainer"))
        m, t = median("mixprec", plain), median("pytorch", plain)
        ma, ta = median("mixprec", acc), median("pytorch", acc)
        mt, tt = median("mixprec", trainer), median("pytorch", trainer)
        table.append([m, t, ma, ta, mt, tt])
        name = precision + (" + GradScaler" if scaler else "")
        # The loop's loss is the same in C++ and Python, so one column serves; but for fp16 where
        # mixprec's fast path is on (fp32 accumulation, one rounding), which LibTorch's fp16
        # kernels round differently from: then PyTorch's is shown beside it.
        loop_loss = f"{loss('mixprec', plain):.6f}"
        if loss("mixprec", plain) != loss("pytorch", plain):
            assert precision == "fp16", (plain, runs)
            loop_loss += f" (PyTorch {loss('pytorch', plain):.6f})"
        losses = f"{loop_loss} / {loss('mixprec', acc):.6f} / {loss('pytorch', acc):.6f}"
        print(f"| {name} | {m:.0f} | {t:.0f} | {m / t:.2f}x | {ma:.0f} | {ta:.0f} | {ma / ta:.2f}x "
              f"| {mt:.0f} | {tt:.0f} | {mt / tt:.2f}x "
              f"| {100 * (paired('mixprec', plain, acc) - 1):+.1f}% / {100 * (paired('mixprec', plain, trainer) - 1):+.1f}% "
              f"| {losses} | {loss('mixprec', trainer):.6f} / {loss('pytorch', trainer):.6f} |")
    print("\nOverhead = loop steps/s / (Accelerator or Trainer) steps/s - 1, the median over the reps of each "
          "rep's (the runs of one precision run back to back). The Trainers run HF's defaults where "
          "the loop has none (clipping at 1, shuffling, no weight decay), so their losses are compared with each "
          "other; HF Accelerate and the HF Trainer train fp16 in fp32 on a CPU (their losses equal fp32's).")
    if args.plot:
        plot_bars(args.plot, f"digits MLP: steps/s (median of {args.reps}), higher is better", "steps/s",
                  ["fp32", "bf16", "fp16 + GradScaler"], table)
    print("\nGradScaler cost in fp16 (share of step time):\n")
    print("| AdamW | mixprec | PyTorch |")
    print("|---|---|---|")
    for optimizer in ("fused", "unfused"):
        cells = []
        for impl in ("mixprec", "pytorch"):
            on_off = paired(impl, ("plain", "fp16", optimizer, True), ("plain", "fp16", optimizer, False))
            cells.append(f"{100 * (1 - on_off):.1f}%")
        print(f"| {optimizer} | {cells[0]} | {cells[1]} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r for rs in runs.values() for r in rs], f, indent=1)


if __name__ == "__main__":
    main()
