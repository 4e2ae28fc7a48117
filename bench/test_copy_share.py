#!/usr/bin/env python3
"""Checks bench/copy_share.py on a made-up mpzero_bench_cuda JSON (CTest bench.copy_share):
the share against the faster copy's median, the range over repetitions, aggregates left
out beside repetitions and used without them (--benchmark_report_aggregates_only), the
size filter, and the errors for a step without its copy and for a bad file."""
import json
import os
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
script = os.path.join(here, "copy_share.py")
failures = []


def run(*args):
    p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def check(cond, what):
    if not cond:
        failures.append(what)


def it(name, rate, bpe=None, aggregate=None):
    """One entry as Google Benchmark writes it: a repetition, or an aggregate of them."""
    b = {"name": name + ("_" + aggregate if aggregate else ""), "run_name": name,
         "run_type": "aggregate" if aggregate else "iteration", "bytes_per_second": rate}
    if aggregate:
        b["aggregate_name"], b["repetitions"] = aggregate, 5
    if bpe is not None:
        b["B/elem"] = float(bpe)
    return b


n = 1 << 20
step = f"BM_cuda_step<policies::bf16_all_sr, optim::adamw>/{n}/manual_time"
bench = [
    # memcpy is the faster copy (median 2.0e12); the copy kernel's 1.8e12 must not be used
    it(f"BM_cuda_memcpy/n:{n}/B/elem:14/manual_time", 1.9e12),
    it(f"BM_cuda_memcpy/n:{n}/B/elem:14/manual_time", 2.0e12),
    it(f"BM_cuda_memcpy/n:{n}/B/elem:14/manual_time", 2.1e12),
    it(f"BM_cuda_copy_kernel/n:{n}/B/elem:14/manual_time", 1.8e12),
    it(step, 1.7e12, 14),
    it(step, 1.6e12, 14),
    it(step, 1.8e12, 14),
    # aggregates beside the repetitions: ignored, the repetitions are there
    it(step, 9.9e12, 14, aggregate="mean"),
    it(step, 9.9e12, 14, aggregate="median"),
    it(f"BM_cuda_memcpy/n:{n}/B/elem:14/manual_time", 9.9e12, aggregate="median"),
    # a small size with its copy at 14 B/elem only
    it("BM_cuda_step<policies::bf16_all_sr, optim::adamw>/65536/manual_time", 0.5e12, 14),
    it("BM_cuda_memcpy/n:65536/B/elem:14/manual_time", 1.0e12),
    # a step whose copy of the same volume (28 B/elem) is missing
    it(f"BM_cuda_step<policies::fp32, optim::adamw>/{n}/manual_time", 2.5e12, 28),
]
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "cuda.json")
    with open(path, "w") as f:
        json.dump({"context": {}, "benchmarks": bench}, f)

    rc, out, err = run(path)
    check(rc == 0, f"exit status {rc}, stderr {err!r}")
    line = next((l for l in out.splitlines() if l.startswith("policies::bf16_all_sr") and str(n) in l), "")
    check("85.0% (80.0-90.0)" in line, f"share of 1M elements: {line!r}")
    check("2.00" in line, f"copy TB/s should be memcpy's median 2.00: {line!r}")
    small = next((l for l in out.splitlines() if " 65536 " in l), "")
    check("50.0%" in small and "(" not in small, f"one repetition prints one number: {small!r}")
    check("policies::fp32, optim::adamw/1048576 (28 B/elem)" in err, f"missing copy not named: {err!r}")
    check("policies::fp32" not in out, "a step without its copy printed a share")

    rc, out, err = run(path, "--min-elements", str(n), "--markdown")
    check(rc == 0 and "65536" not in out and out.startswith("| step |"), f"--min-elements/--markdown: {out!r}")

    with open(path, "w") as f:
        f.write("{not json")
    rc, out, err = run(path)
    check(rc != 0 and "is not JSON" in err, f"bad JSON: rc {rc}, {err!r}")
    # --benchmark_report_aggregates_only=true: only medians (and means, ignored)
    only = [it(f"BM_cuda_memcpy/n:{n}/B/elem:14/manual_time", 2.0e12, aggregate="median"),
            it(f"BM_cuda_memcpy/n:{n}/B/elem:14/manual_time", 1.0e12, aggregate="mean"),
            it(step, 1.8e12, 14, aggregate="median"),
            it(step, 0.1e12, 14, aggregate="mean")]
    with open(path, "w") as f:
        json.dump({"context": {}, "benchmarks": only}, f)
    rc, out, err = run(path)
    line = next((l for l in out.splitlines() if l.startswith("policies::bf16_all_sr")), "")
    check(rc == 0 and "median of 5" in line and "90.0%" in line and "(" not in line.split("%")[1],
          f"aggregates only: the medians are used (rc {rc}): {line!r} {err!r}")

    rc, out, err = run(os.path.join(tmp, "absent.json"))
    check(rc != 0 and "cannot read" in err and "absent.json" in err, f"absent file: rc {rc}, {err!r}")

if failures:
    print("test_copy_share: FAILED\n  " + "\n  ".join(failures))
    sys.exit(1)
print("test_copy_share: all checks passed")
