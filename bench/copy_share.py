#!/usr/bin/env python3
"""The fused step's speed as a share of device copy bandwidth (the CUDA step's target
measure, docs/perf.md "CUDA step against device copy bandwidth"), from
mpzero_bench_cuda's JSON output (--benchmark_out=FILE --benchmark_out_format=json).

    python3 bench/copy_share.py bench_cuda.json [--min-elements 16777216] [--markdown]

Each step benchmark (BM_cuda_step<policy, optimizer[, tuning]>/N) is set against the
faster of the two copies of the same volume (BM_cuda_memcpy and BM_cuda_copy_kernel at
the same N and bytes per element), both counting reads and writes. With
--benchmark_repetitions=K, every repetition of the step is divided by the copy's median
over its repetitions, and the share is printed as the median with the lowest and highest
repetition; one repetition prints one number. A file written with
--benchmark_report_aggregates_only=true has no repetitions, only their median, which is
then used for the step and the copy alike (the range is not known: "median of K").
"""
import argparse
import json
import re
import statistics
import sys
from collections import defaultdict

STEP = re.compile(r"^BM_cuda_step<(?P<args>.*)>/(?P<n>\d+)(/|$)")
COPY = re.compile(r"^BM_cuda_(?P<kind>memcpy|copy_kernel)/n:(?P<n>\d+)/B/elem:(?P<bpe>\d+)(/|$)")


def load(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        sys.exit(f"copy_share: cannot read {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        sys.exit(f"copy_share: {path} is not JSON ({e}); write it with --benchmark_out_format=json")
    if not isinstance(data, dict) or "benchmarks" not in data:
        sys.exit(f"copy_share: {path} has no 'benchmarks': not Google Benchmark's JSON output")
    return data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="mpzero_bench_cuda's --benchmark_out file")
    ap.add_argument("--min-elements", type=int, default=0, help="leave out steps below this many elements")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()
    data = load(args.json)

    # (args, n, bytes per element) or (kind, n, bytes per element) -> bytes/s of each
    # repetition; the medians that Google Benchmark wrote beside them, with their counts,
    # stand in for a benchmark whose repetitions the file does not hold.
    steps, copies = defaultdict(list), defaultdict(list)
    step_medians, copy_medians = {}, {}
    for b in data["benchmarks"]:
        kind = b.get("run_type", "iteration")
        if "bytes_per_second" not in b or (kind == "aggregate" and b.get("aggregate_name") != "median"):
            continue  # the other aggregates (mean, stddev, cv) are not used
        name = b.get("run_name", b["name"])
        bpe = b.get("B/elem")
        if m := STEP.match(name):
            if bpe is None:
                sys.exit(f"copy_share: {name} has no 'B/elem' counter: an mpzero_bench_cuda older than this script?")
            key, rates, medians = (m["args"], int(m["n"]), int(round(bpe))), steps, step_medians
        elif m := COPY.match(name):
            key, rates, medians = (m["kind"], int(m["n"]), int(m["bpe"])), copies, copy_medians
        else:
            continue
        if kind == "aggregate":
            medians[key] = (b["bytes_per_second"], b.get("repetitions", 0))
        else:
            rates[key].append(b["bytes_per_second"])
    aggregated = set()
    for rates, medians in ((steps, step_medians), (copies, copy_medians)):
        for key, (rate, reps) in medians.items():
            if key not in rates:
                rates[key] = [rate]
                aggregated.add(key)
    if not steps:
        sys.exit(f"copy_share: {args.json} holds no BM_cuda_step results (was --benchmark_filter too narrow?)")

    rows, missing = [], []
    for (what, n, bpe), rates in sorted(steps.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if n < args.min_elements:
            continue
        base = [statistics.median(copies[(k, n, bpe)]) for k in ("memcpy", "copy_kernel") if copies.get((k, n, bpe))]
        if not base:
            missing.append(f"{what}/{n} ({bpe} B/elem)")
            continue
        copy = max(base)
        shares = sorted(r / copy for r in rates)
        reps = f"median of {step_medians[(what, n, bpe)][1]}" if (what, n, bpe) in aggregated else len(rates)
        rows.append((what, n, bpe, reps, statistics.median(shares), shares[0], shares[-1], copy))
    if missing:
        print("copy_share: no copy of the same volume for " + ", ".join(missing) +
              "; run BM_cuda_memcpy or BM_cuda_copy_kernel too (e.g. --benchmark_filter='policy|memcpy')",
              file=sys.stderr)
    if not rows:
        sys.exit(1)

    def share(r):
        med, lo, hi = r[4:7]
        return f"{100 * med:.1f}%" if lo == hi else f"{100 * med:.1f}% ({100 * lo:.1f}-{100 * hi:.1f})"

    header = ("step", "elements", "B/elem", "reps", "share of copy (median, range)", "copy TB/s")
    cells = [(r[0], str(r[1]), str(r[2]), str(r[3]), share(r), f"{r[7] / 1e12:.2f}") for r in rows]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for c in cells:
            print("| " + " | ".join(c) + " |")
    else:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
        for line in [header] + cells:
            print("  ".join(s.ljust(w) for s, w in zip(line, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
