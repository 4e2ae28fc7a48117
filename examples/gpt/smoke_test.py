#!/usr/bin/env python3
"""CTest's check of the main job (examples.main_job.np1/np2): runs train_gpt on a tiny
model for a few configurations, draws the plots, and checks what it promises:

- every selected configuration trained (none refused), the outputs exist and agree
  (results.json, summary.csv, loss_curves.png, memory.png);
- the measured bytes of model states per parameter equal the memory model's prediction;
- the losses are finite and fall (the model learns);
- the same precision at two ZeRO stages (stage 3 with its blocks gathered around forward and
  backward, --persistence 100 so that the matrices are partitioned), or with and without CPU offload, gives the same
  losses bit for bit (the core's promise), while stochastic rounding and autocast change them (they are wired through);
- the "-ac" configurations ran under autocast and the others did not;
- memory_by_world.py (the main job's table across world sizes) reproduces results.json's
  numbers for this world size;
- the DeepSpeed blog's comparison in results.json covers every all-bf16 row against
  bf16/z2 and agrees with the rows it summarises;
- the engine in fp32 trains like LibTorch's own torch::optim::AdamW (the "torch" row:
  same model, batches and hyperparameters, no mpzero) to within rounding, with the
  constant rate and with --lr-schedule cosine (the engine's WarmupCosineLR, which the
  reference follows through the same formula);
- compare_seeds.py: the paired changes and their verdicts, a summary read back in place of
  its runs, a seed given twice refused, and runs that differ in more than the seed refused,
  naming what differs;
- a diverged run's null losses still plot; bad flags (a number with trailing junk, an
  --out or --save that cannot be written) are refused before anything trains; a run that
  stops during training is listed as not finished and the next configuration still runs;
- --save: every mpzero configuration left a checkpoint (shards, engine files) and a
  safetensors fp32 export whose header is well formed; a fresh fp32 model loaded from the
  export evaluates to the training's held-out loss exactly where training ran in fp32,
  and close to it elsewhere.

The corpus is the repository's own Markdown in fortune format, so no Debian package is
needed.

    smoke_test.py --train-gpt PATH --plot examples/gpt/plot.py --repo DIR --work DIR
                  [--launcher "mpirun -n 2 ..."]
"""
import argparse
import csv
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

CONFIGS = [
    "fp32/z0",
    "fp32-ac/z0",
    "bf16/z2",
    "bf16/z2+off",
    "bf16-all/z1",
    "bf16-all/z2",
    "bf16-all/z3",
    "bf16-all-sr/z2",
    "bf16-all-ac/z2",
    "fp16/z2",
    "fp16-master/z2",
    "fp16-master/z2+off",
    "fp16-master/z3+off",
    "torch",
]
TINY = ["--steps", "30", "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "4",
        "--eval-batches", "2", "--device", "cpu", "--persistence", "100"]

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def make_corpus(repo, dest):
    """The repository's Markdown as fortune files: one paragraph per fortune."""
    os.makedirs(dest, exist_ok=True)
    sources = [os.path.join(repo, "README.md")]
    docs = os.path.join(repo, "docs")
    sources += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    for i, src in enumerate(sources):
        with open(src, encoding="utf-8") as f:
            paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
        with open(os.path.join(dest, "doc%02d" % i), "w", encoding="utf-8") as f:
            f.write("\n%\n".join(paragraphs) + "\n%\n")


def safetensors_header(path):
    """The JSON header of a safetensors file, checked against the format: 8-byte
    little-endian size, the header padded to 8 bytes, the data indexed without gaps."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    contiguous = all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[0][0] == 0
    ok = n % 8 == 0 and contiguous and spans[-1][1] == len(raw) - 8 - n
    return header, ok


def check_saved(runs, saved, world):
    for cid, r in runs.items():
        if cid == "torch":
            check(r["checkpoint"] is None, "torch: no checkpoint (no engine)")
            continue
        tag = cid.replace("/", "_")
        d = os.path.join(saved, tag)
        check(r["checkpoint"] == d, "%s: checkpoint in %s (got %s)" % (cid, d, r["checkpoint"]))
        files = ["mpzero_engine.json", "model_states.pt", "zero_shard_00000.mpz", "fp32.safetensors"]
        if not cid.endswith("z0") and world > 1:
            files.append("zero_shard_00001.mpz")
        missing = [f for f in files if not os.path.isfile(os.path.join(d, f))]
        check(not missing, "%s: %s written (missing: %s)" % (cid, ", ".join(files), missing))
        if missing:
            continue
        header, ok = safetensors_header(os.path.join(d, "fp32.safetensors"))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        check(ok and tensors and all(v["dtype"] == "F32" for v in tensors.values()),
              "%s: fp32.safetensors is well formed, %d fp32 tensors" % (cid, len(tensors)))
        exp, ev = r["export_eval_loss"], r["eval_loss"]
        if cid.startswith("fp32/"):
            check(exp == ev, "%s: the fp32 export evaluates to the training's held-out loss (%r, %r)" % (cid, exp, ev))
        else:
            check(exp is not None and abs(exp - ev) < 0.05 * ev,
                  "%s: the fp32 export's held-out loss %s is within 5%% of training's %.4f" % (cid, exp, ev))
    check(not os.path.exists(os.path.join(saved, "latest")), "--save writes no 'latest' (one tag per configuration)")


def check_memory_by_world(out, runs, world):
    """memory_by_world.py (main_gpt.sh's table across world sizes) on this run: one CSV row
    per mpzero configuration at this world size, its numbers those of results.json."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_by_world.py")
    rc = subprocess.call([sys.executable, script, os.path.join(out, "results.json"), "--out", out])
    check(rc == 0, "memory_by_world.py exits 0 (got %d)" % rc)
    check(os.path.getsize(os.path.join(out, "memory_by_world.png")) > 0, "memory_by_world.png written")
    with open(os.path.join(out, "memory_by_world.csv")) as f:
        rows = list(csv.DictReader(f))
    mpzero = {k: r for k, r in runs.items() if k != "torch"}
    check(sorted(r["config"] for r in rows) == sorted(mpzero), "memory_by_world.csv: one row per mpzero configuration")
    mib = 1 << 20
    for r in rows:
        run = mpzero[r["config"]]
        held = (run["measured_device_bytes"] + run["measured_host_bytes"]) / mib
        ok = (int(r["world_size"]) == world and abs(float(r["measured_bytes_per_param"]) - run["measured_bytes_per_param"]) < 1e-4
              and abs(float(r["held_mib"]) - held) < 1e-4
              and abs(float(r["peak_mib"]) - held - run["bucket_bytes"] / mib) < 1e-3)
        check(ok, "memory_by_world.csv: %s at world %d matches results.json" % (r["config"], world))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--plot", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--launcher", default="")
    ap.add_argument("--world", type=int, default=1)
    a = ap.parse_args()

    shutil.rmtree(a.work, ignore_errors=True)
    corpus, out = os.path.join(a.work, "corpus"), os.path.join(a.work, "out")
    saved = os.path.join(a.work, "ckpt")
    make_corpus(a.repo, corpus)
    cmd = shlex.split(a.launcher) + [a.train_gpt, *TINY, "--configs", ",".join(CONFIGS), "--corpus", corpus,
                                     "--out", out, "--save", saved]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    check(rc == 0, "train_gpt exits 0 (got %d)" % rc)
    if rc != 0:
        return 1
    rc = subprocess.call([sys.executable, a.plot, os.path.join(out, "results.json")])
    check(rc == 0, "plot.py exits 0 (got %d)" % rc)
    for f in ("results.json", "summary.csv", "loss_curves.png", "memory.png"):
        p = os.path.join(out, f)
        check(os.path.isfile(p) and os.path.getsize(p) > 0, "%s written" % f)
        check(not os.path.exists(p + ".tmp"), "%s.tmp renamed away" % f)

    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    runs = {r["id"]: r for r in res["runs"]}

    # Reduction buffers at their peak (engine.memory().peak_buckets; they are freed between
    # steps): stages 2-3 reduce in buckets above world size 1. One rank has nothing to
    # reduce: stage 2 adds straight into the gradient partition and holds none, on the CPU
    # with offload too (on a GPU, offload stages its buckets for the copy to host memory).
    # Stages 0-1 reduce in place, and so hold none unless autocast sends some gradients in
    # another dtype (fp32-ac: Linear gradients in bf16); the torch row has none. The
    # bucket size is DeepSpeed's default unless --bucket sets it, and a smaller one holds less.
    check(res["meta"].get("reduce_bucket_size") == 500000000,
          "meta.reduce_bucket_size is the default 5e8 (got %r)" % res["meta"].get("reduce_bucket_size"))
    on_gpu = res["meta"].get("device", "cpu") != "cpu"
    # Stage 3 reduces as stage 2 does; its gathers are released by the time memory is read.
    for cid, r in runs.items():
        b = r.get("bucket_bytes")
        bucketed = "/z2" in cid or "/z3" in cid
        if bucketed and (a.world > 1 or (on_gpu and "+off" in cid)):
            check(isinstance(b, int) and b > 0, "%s: bucket_bytes %r > 0 (stages 2-3 reduce in buckets)" % (cid, b))
        elif cid.startswith("fp32-ac"):
            check(isinstance(b, int) and b > 0, "%s: bucket_bytes %r > 0 (bf16 gradients on the wire)" % (cid, b))
        elif "-ac" in cid:
            continue
        elif bucketed:
            check(b == 0, "%s: bucket_bytes %r == 0 (one rank: straight into the gradient)" % (cid, b))
        else:
            check(b == 0, "%s: bucket_bytes %r == 0 (reduced in place)" % (cid, b))
    def run_tiny(name, configs, *extra):
        """train_gpt on the tiny model into work/<name>: its process and results (None if it failed)."""
        dest = os.path.join(a.work, name)
        p = subprocess.run([a.train_gpt, *TINY, *extra, "--configs", configs, "--corpus", corpus, "--out", dest],
                           capture_output=True, text=True)
        if p.returncode != 0:
            return p, None
        with open(os.path.join(dest, "results.json")) as f:
            return p, json.load(f)

    if a.world == 1 and "fp32-ac/z0" in runs:
        # (fp32-ac's bf16 wire goes through buffers of at most a bucket at every world size.)
        p, small = run_tiny("small_bucket", "fp32-ac/z0", "--steps", "3", "--bucket", "64")
        check(p.returncode == 0, "train_gpt --bucket 64 exits 0 (rc %d, stderr %r)" % (p.returncode, p.stderr[-300:]))
        if small is not None:
            got = small["runs"][0]["bucket_bytes"]
            check(small["meta"]["reduce_bucket_size"] == 64 and 0 < got < runs["fp32-ac/z0"]["bucket_bytes"],
                  "--bucket 64: meta says 64 and fp32-ac/z0 holds fewer bucket bytes (%d) than with the default (%d)" %
                  (got, runs["fp32-ac/z0"]["bucket_bytes"]))

    # --rounds: one round by default; with 2, each configuration is timed twice, its
    # steps/s is the median of the two (their mean) and the step-time change against the
    # base the median of the two rounds' paired ratios.
    check(res["meta"].get("rounds") == 1 and all(len(r["steps_per_s_rounds"]) == 1 for r in res["runs"]),
          "one round by default: meta.rounds 1, one steps_per_s_rounds entry per run")
    if a.world == 1:
        p, twice = run_tiny("rounds", "bf16/z2,bf16-all/z2", "--steps", "4", "--rounds", "2")
        check(p.returncode == 0, "train_gpt --rounds 2 exits 0 (rc %d, stderr %r)" % (p.returncode, p.stderr[-300:]))
        if twice is not None:
            by = {r["id"]: r for r in twice["runs"]}
            for cid, r in by.items():
                sp = r["steps_per_s_rounds"]
                check(len(sp) == 2 and min(sp) > 0 and abs(r["steps_per_s"] - (sp[0] + sp[1]) / 2) <= 1e-9 * r["steps_per_s"],
                      "--rounds 2, %s: two timings %r, steps_per_s %r their median" % (cid, sp, r["steps_per_s"]))
            cmp = [e for e in twice["blog_comparison"] if e["id"] == "bf16-all/z2"]
            check(len(cmp) == 1, "--rounds 2: the blog comparison has bf16-all/z2")
            if cmp:
                b, r = by["bf16/z2"]["steps_per_s_rounds"], by["bf16-all/z2"]["steps_per_s_rounds"]
                want = [b[k] / r[k] - 1 for k in range(2)]
                got = cmp[0]["step_time_change_rounds"]
                check(len(got) == 2 and all(abs(g - w) <= 1e-9 for g, w in zip(got, want)) and
                      abs(cmp[0]["step_time_change"] - sum(want) / 2) <= 1e-9,
                      "--rounds 2: step_time_change_rounds %r are the paired ratios %r, step_time_change their median"
                      % (got, want))
            check(twice["meta"]["rounds"] == 2 and twice["meta"]["configs_done"] == 2,
                  "--rounds 2: meta.rounds 2, configs_done counts configurations (got %r)" % twice["meta"])

    # --lr-schedule cosine: the engine's WarmupCosineLR over the run, which the LibTorch
    # reference follows too (fp32/z0 and torch still agree step for step); the losses move
    # away from the constant rate's from the first update on (a cosine schedule's first
    # update has rate 0, DeepSpeed's WarmupCosineLR).
    if a.world == 1:
        sched = {}
        for mode in ("constant", "cosine"):
            p, r = run_tiny("lr_" + mode, "fp32/z0,torch", "--steps", "6", "--lr-schedule", mode)
            check(p.returncode == 0, "train_gpt --lr-schedule %s exits 0 (rc %d, stderr %r)" % (mode, p.returncode, p.stderr[-300:]))
            if r is not None:
                sched[mode] = {x["id"]: x for x in r["runs"]}
                want = None if mode == "constant" else {
                    "type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                         "warmup_type": "linear", "cos_min_ratio": 0.1}}
                check(r["meta"].get("lr_schedule", "absent") == want and
                      (", cosine schedule (WarmupCosineLR" in p.stdout) == (mode == "cosine"),
                      "--lr-schedule %s: meta.lr_schedule %r and the header line say so" % (mode, r["meta"].get("lr_schedule")))
        if len(sched) == 2:
            c, k = sched["cosine"], sched["constant"]
            gap = max(abs(x - y) for x, y in zip(c["fp32/z0"]["train_loss"], c["torch"]["train_loss"]))
            check(gap < 1e-4, "--lr-schedule cosine: fp32/z0 and torch follow the same rates (largest loss gap %.2g)" % gap)
            check(c["fp32/z0"]["train_loss"][0] == k["fp32/z0"]["train_loss"][0] and
                  c["fp32/z0"]["train_loss"][2:] != k["fp32/z0"]["train_loss"][2:],
                  "--lr-schedule cosine: the same first loss, then other losses than the constant rate's")

    # --cpu-matmul: auto measured LibTorch's 16-bit kernels here against the fp32 path and
    # chose per dtype and kind of op (products, attention). fp32 products of the 16-bit
    # values and LibTorch's 16-bit kernels train the same 16-bit model: fp32 rows equal to
    # the bit, 16-bit rows close (both round each product's result to 16 bits; they differ
    # in how the kernels accumulate).
    cm = res["meta"].get("cpu_matmul", {})
    ops = ("products", "attention")

    def follows_ratio(h):
        c, r = cm.get(h), cm.get(h + "_vs_fp32")
        return (isinstance(c, dict) and isinstance(r, dict) and
                all(c.get(op) in ("fp32", "native") and isinstance(r.get(op), (int, float)) and r[op] > 0 and
                    (c[op] == "fp32") == (r[op] > 2) for op in ops))
    check(cm.get("mode") == "auto" and follows_ratio("bf16") and follows_ratio("fp16"),
          "meta.cpu_matmul: auto, a choice per dtype and op that follows its measured ratio (> 2: fp32) (got %r)" % cm)
    if a.world == 1:
        modes = {}
        for mode in ("native", "fp32"):
            p, r = run_tiny("matmul_" + mode, "fp32/z0,bf16/z0,fp16-master/z2,bf16-all-ac/z2", "--steps", "5",
                            "--cpu-matmul", mode)
            check(p.returncode == 0, "train_gpt --cpu-matmul %s exits 0 (rc %d, stderr %r)" % (mode, p.returncode, p.stderr[-300:]))
            if r is not None:
                rc = r["meta"]["cpu_matmul"]
                check(all(rc[h][op] == mode and rc[h + "_vs_fp32"][op] is None for h in ("bf16", "fp16") for op in ops) and
                      ("in fp32 from 16-bit values" in p.stdout) == (mode == "fp32") and
                      ("in LibTorch's 16-bit kernels" in p.stdout) == (mode == "native"),
                      "--cpu-matmul %s: meta and the header line say so (got %r)" % (mode, r["meta"]["cpu_matmul"]))
                modes[mode] = {x["id"]: x for x in r["runs"]}
        if len(modes) == 2:
            n, f = modes["native"], modes["fp32"]
            check(n["fp32/z0"]["train_loss"] == f["fp32/z0"]["train_loss"], "--cpu-matmul leaves fp32 rows as they are")
            for cid in ("bf16/z0", "fp16-master/z2", "bf16-all-ac/z2"):
                a_, b_ = n[cid]["train_loss"], f[cid]["train_loss"]
                check(len(a_) == len(b_) == 5 and all(abs(x - y) <= 0.02 * abs(x) for x, y in zip(a_, b_)),
                      "%s: LibTorch's 16-bit products and fp32 ones of the 16-bit values train alike (%r vs %r)" %
                      (cid, a_, b_))
            # ... but not identically: the fp32 products are in use.
            check(any(n[c]["train_loss"] != f[c]["train_loss"] for c in ("bf16/z0", "fp16-master/z2", "bf16-all-ac/z2")),
                  "--cpu-matmul fp32 changes the 16-bit rows' losses (it computes their products another way)")

    # compare_seeds.py (the stochastic-rounding criterion across seeds): two real runs that
    # differ in --seed, then made-up losses whose verdicts are known.
    if a.world == 1:
        compare = os.path.join(os.path.dirname(a.plot), "compare_seeds.py")
        seeded = []
        for seed in ("7", "8"):
            # --cpu-matmul pinned: auto decides by timing, which may choose differently for
            # the two runs, and compare_seeds.py rightly refuses runs that differ in more
            # than the seed.
            p, r = run_tiny("seed" + seed, "fp32/z0,bf16-all-sr/z2", "--steps", "4", "--seed", seed,
                            "--cpu-matmul", "native")
            check(p.returncode == 0, "train_gpt --seed %s exits 0 (rc %d, stderr %r)" % (seed, p.returncode, p.stderr[-300:]))
            if r is not None:
                seeded.append((os.path.join(a.work, "seed" + seed, "results.json"), r))
        if len(seeded) == 2:
            summary = os.path.join(a.work, "seeds_summary.json")
            p = subprocess.run([sys.executable, compare, *[f for f, _ in seeded], "--json", summary],
                               capture_output=True, text=True)
            check(p.returncode == 0 and "bf16-all-sr/z2" in p.stdout,
                  "compare_seeds.py exits 0 and lists bf16-all-sr/z2 (rc %d, %r)" % (p.returncode, p.stdout + p.stderr))
            if p.returncode == 0:
                with open(summary) as f:
                    s = json.load(f)
                want = []
                for _, r in seeded:
                    ev = {x["id"]: x["eval_loss"] for x in r["runs"]}
                    want.append(ev["bf16-all-sr/z2"] / ev["fp32/z0"] - 1)
                got = [c for c in s["configs"] if c["id"] == "bf16-all-sr/z2"][0]
                check(s["seeds"] == [7, 8] and len(got["changes"]) == 2 and
                      all(abs(g - w) <= 1e-12 for g, w in zip(got["changes"], want)) and
                      abs(got["change_vs_base"] - sum(want) / 2) <= 1e-12,
                      "compare_seeds.py: the paired changes %r are each seed's ratio %r, and their mean" %
                      (got["changes"], want))
            p = subprocess.run([sys.executable, compare, seeded[0][0], seeded[0][0]], capture_output=True, text=True)
            check(p.returncode != 0 and "repeats seed 7" in p.stderr,
                  "compare_seeds.py refuses the same seed twice (%r)" % p.stderr)
            # The summary stands in for its runs (a series kept over several runs): the same
            # seeds and changes again; with one of its runs beside it, that seed twice.
            check(os.path.isfile(summary), "compare_seeds.py --json wrote %s" % summary)
            if os.path.isfile(summary):
                again = os.path.join(a.work, "seeds_summary_again.json")
                p = subprocess.run([sys.executable, compare, summary, "--json", again], capture_output=True, text=True)
                check(p.returncode == 0, "compare_seeds.py reads its own summary (%r)" % (p.stdout + p.stderr))
                if p.returncode == 0:
                    with open(summary) as f, open(again) as g:
                        s1, s2 = json.load(f), json.load(g)
                    check(s1["seeds"] == s2["seeds"] and s1["recipe"] == s2["recipe"] and s1["configs"] == s2["configs"] and
                          s1["recipe"]["steps"] == 4 and s1["recipe"]["lr_schedule"] is None,
                          "compare_seeds.py: a summary summarized again gives the same seeds, recipe and changes")
                p = subprocess.run([sys.executable, compare, summary, seeded[1][0]], capture_output=True, text=True)
                check(p.returncode != 0 and "repeats seed 8" in p.stderr,
                      "compare_seeds.py refuses a seed that a summary already holds (%r)" % p.stderr)
            # Runs trained otherwise (here 6 steps under a cosine rate) are not compared.
            other = os.path.join(a.work, "lr_cosine", "results.json")
            check(os.path.isfile(other), "the --lr-schedule cosine run above left %s" % other)
            if os.path.isfile(other):
                p = subprocess.run([sys.executable, compare, seeded[0][0], other], capture_output=True, text=True)
                check(p.returncode != 0 and "was trained otherwise than" in p.stderr and "steps 4 there, 6 here" in p.stderr
                      and "lr_schedule None there" in p.stderr,
                      "compare_seeds.py refuses runs that differ in more than the seed, naming what (%r)" % p.stderr)
            p = subprocess.run([sys.executable, compare, seeded[0][0], "--base", "fp64/z9"], capture_output=True, text=True)
            check(p.returncode != 0 and "'fp64/z9' is in none of the runs" in p.stderr,
                  "compare_seeds.py names a base that no run holds (%r)" % p.stderr)
        # Made-up losses: a change of +0.1% with little spread is within 0.5%, +2% outside,
        # and +0.4% with a spread of several percent undecided.
        made = []
        for k, (sr, far, noisy, nan) in enumerate([(1.001, 1.020, 1.06, 1.0), (1.0012, 1.021, 0.95, None),
                                                     (1.0008, 1.019, 1.01, 1.0)]):
            d = os.path.join(a.work, "made_seed%d" % k)
            os.makedirs(d, exist_ok=True)
            base = 2.0 + 0.1 * k
            fake = {"meta": {"seed": 100 + k}, "runs": [{"id": "fp32/z0", "eval_loss": base},
                                                       {"id": "sr", "eval_loss": base * sr},
                                                       {"id": "far", "eval_loss": base * far},
                                                       {"id": "noisy", "eval_loss": base * noisy},
                                                       {"id": "nan", "eval_loss": None if nan is None else base * nan}]}
            made.append(os.path.join(d, "results.json"))
            with open(made[-1], "w") as f:
                json.dump(fake, f)
        summary = os.path.join(a.work, "made_summary.json")
        p = subprocess.run([sys.executable, compare, *made, "--json", summary], capture_output=True, text=True)
        check(p.returncode == 0, "compare_seeds.py on made-up losses exits 0 (%r)" % (p.stdout + p.stderr))
        if p.returncode == 0:
            with open(summary) as f:
                verdicts = {c["id"]: c.get("verdict") for c in json.load(f)["configs"]}
            check(verdicts == {"fp32/z0": None, "sr": "within", "far": "outside", "noisy": "undecided", "nan": "diverged"},
                  "compare_seeds.py verdicts: +0.1%% within, +2%% outside, noisy undecided, a null loss on one "
                  "seed diverged (got %r)" % verdicts)
            check("diverged (seeds 101)" in p.stdout, "compare_seeds.py names the seed a run diverged on (%r)" % p.stdout)

    # The GPU's memory plot (a second panel of peak device memory) drawn from these results
    # with made-up peaks: it must exist and be wider than the CPU's single panel.
    shaped = os.path.join(a.work, "gpu_shaped")
    os.makedirs(shaped, exist_ok=True)
    gpu_res = json.loads(json.dumps(res))
    for i, r in enumerate(gpu_res["runs"]):
        r["peak_device_bytes"] = (900 + 50 * i) << 20
    with open(os.path.join(shaped, "results.json"), "w") as f:
        json.dump(gpu_res, f)
    rc = subprocess.call([sys.executable, a.plot, os.path.join(shaped, "results.json")])
    check(rc == 0, "plot.py exits 0 on GPU-shaped results (got %d)" % rc)

    # Skipped steps: every run lists them (as many as it counts), and the plot marks them;
    # drawn here from these results with made-up skips, since the tiny fp16 runs skip none.
    for r in res["runs"]:
        check("skipped_at" in r and len(r["skipped_at"]) == r["skipped_steps"] and
              all(1 <= x <= res["meta"]["steps"] for x in r["skipped_at"]),
              "%s: skipped_at lists its %d skipped steps (got %s)" % (r["id"], r["skipped_steps"], r.get("skipped_at")))
    # Two plots with the same title (both list skipped steps): one whose steps are all out
    # of range (no cross drawn), one with crosses. They differ only if crosses are drawn.
    pngs = []
    for name, at in (("skipped_none_drawn", [10 ** 6]), ("skipped_plot", [1, 2, 5, res["meta"]["steps"]])):
        marked = os.path.join(a.work, name)
        os.makedirs(marked, exist_ok=True)
        skip_res = json.loads(json.dumps(res))
        for r in skip_res["runs"]:
            if r["precision"].startswith("fp16"):
                r["skipped_at"], r["skipped_steps"] = at, len(at)
        with open(os.path.join(marked, "results.json"), "w") as f:
            json.dump(skip_res, f)
        rc = subprocess.call([sys.executable, a.plot, os.path.join(marked, "results.json")])
        check(rc == 0 and os.path.isfile(os.path.join(marked, "loss_curves.png")),
              "plot.py draws results with skipped steps %s (got %d)" % (at, rc))
        with open(os.path.join(marked, "loss_curves.png"), "rb") as f:
            pngs.append(f.read() if rc == 0 else b"")
    check(pngs[0] != pngs[1], "plot.py draws crosses at the skipped steps")

    # A diverged run: train_gpt writes its NaN losses as null. The plots still come out.
    diverged = os.path.join(a.work, "diverged_plot")
    os.makedirs(diverged, exist_ok=True)
    nan_res = json.loads(json.dumps(res))
    bad = nan_res["runs"][-1]
    bad["train_loss"] = bad["train_loss"][:10] + [None] * (len(bad["train_loss"]) - 10)
    bad["eval_loss"] = None
    with open(os.path.join(diverged, "results.json"), "w") as f:
        json.dump(nan_res, f)
    rc = subprocess.call([sys.executable, a.plot, os.path.join(diverged, "results.json")])
    check(rc == 0 and os.path.isfile(os.path.join(diverged, "loss_curves.png")),
          "plot.py draws results with null (NaN) losses (got %d)" % rc)

    if a.world == 1:
        # Bad flags are refused before anything trains, naming the value.
        def refused(extra, want):
            p = subprocess.run([a.train_gpt, *TINY, "--configs", "fp32/z0", "--corpus", corpus, "--out", out, *extra],
                               capture_output=True, text=True)
            check(p.returncode != 0 and want in p.stderr and "step " not in p.stderr,
                  "train_gpt %s is refused before training with '%s' (rc %d, stderr %r)" %
                  (" ".join(extra), want, p.returncode, p.stderr[-300:]))
        refused(["--steps", "4x"], "--steps 4x: not an integer")
        refused(["--lr", "3e-3abc"], "--lr 3e-3abc: not a number")
        refused(["--seed", "-1"], "--seed -1: not an integer from 0 to 18446744073709551615")
        for bad in ("0", "-5", "5e7"):
            refused(["--bucket", bad], "--bucket %s: must be a positive whole number of elements" % bad)
        refused(["--rounds", "0"], "--rounds 0: must be at least 1")
        refused(["--cpu-matmul", "fast"], "--cpu-matmul fast: not a mode; use auto, fp32 or native")
        refused(["--lr-schedule", "linear"], "--lr-schedule linear: not a schedule; use constant or cosine")
        blocker = os.path.join(a.work, "a_file")
        with open(blocker, "w") as f:
            f.write("not a directory\n")
        refused(["--out", os.path.join(blocker, "out")], "cannot write there")
        refused(["--save", os.path.join(blocker, "ckpt")], "--save")

        # A run that stops (fp16 overflowing at its minimum loss scale, from a far too large
        # learning rate) is reported as not finished; the next configuration still runs, and
        # becomes the base, which the table says. (A seed above 2^32 is taken: seeds are 64 bits.)
        p, stopped = run_tiny("stopped", "fp16/z0,fp32/z0", "--lr", "100", "--seed", "30000000000")
        check(p.returncode == 0, "train_gpt goes on after a run stops (rc %d, stderr %r)" % (p.returncode, p.stderr[-400:]))
        if stopped is not None:
            check([r["id"] for r in stopped["runs"]] == ["fp32/z0"], "the fp32 run finished after fp16 stopped")
            check(len(stopped["not_run"]) == 1 and stopped["not_run"][0]["id"] == "fp16/z0" and
                  stopped["not_run"][0]["reason"].startswith("stopped during training"),
                  "fp16/z0 is listed as not finished, with the reason (got %s)" % stopped["not_run"])
            check("fp16/z0, did not finish: fp32/z0 is the base instead" in p.stdout,
                  "the table says fp32/z0 is the base because fp16/z0 did not finish")
            check(stopped["meta"]["seed"] == 30000000000, "--seed 30000000000 is taken (got %s)" % stopped["meta"]["seed"])

    def png_width(path):
        with open(path, "rb") as f:
            head = f.read(24)
        return int.from_bytes(head[16:20], "big") if head[:8] == b"\x89PNG\r\n\x1a\n" else 0

    w_cpu, w_gpu = png_width(os.path.join(out, "memory.png")), png_width(os.path.join(shaped, "memory.png"))
    check(w_gpu > w_cpu > 0, "GPU memory.png has the peak panel (width %d px against %d)" % (w_gpu, w_cpu))
    check(res["meta"]["world_size"] == a.world, "world size %d (got %s)" % (a.world, res["meta"]["world_size"]))
    check(list(runs) == CONFIGS, "every configuration trained, in order (got %s)" % list(runs))
    check(res["not_run"] == [], "none refused (got %s)" % res["not_run"])
    check(res["meta"]["configs_done"] == res["meta"]["configs_total"] == len(CONFIGS),
          "meta counts every configuration done (got %s of %s)" % (res["meta"]["configs_done"],
                                                                    res["meta"]["configs_total"]))
    with open(os.path.join(out, "summary.csv")) as f:
        rows = list(csv.DictReader(f))
    check([r["id"] for r in rows] == list(runs), "summary.csv has one row per configuration")

    for cid, r in runs.items():
        measured, predicted = r["measured_bytes_per_param"], r["predicted_bytes_per_param"]
        check(abs(measured - predicted) < 1e-9, "%s: %.4f B/param measured == %.4f predicted" % (cid, measured, predicted))
        losses = r["train_loss"]
        check(len(losses) == 30 and all(math.isfinite(x) for x in losses), "%s: 30 finite training losses" % cid)
        check(math.isfinite(r["eval_loss"]), "%s: finite eval loss %.4f" % (cid, r["eval_loss"]))
        late = sum(losses[-5:]) / 5
        check(late < losses[0] - 0.5, "%s: the loss falls (%.3f -> %.3f)" % (cid, losses[0], late))
        want_ac = cid.split("/")[0].endswith("-ac")
        check(r["autocast"] == want_ac, "%s: autocast %s" % (cid, want_ac))

    def same(x, y):
        return runs[x]["train_loss"] == runs[y]["train_loss"] and runs[x]["eval_loss"] == runs[y]["eval_loss"]

    check(same("bf16-all/z1", "bf16-all/z2"), "bf16-all: stages 1 and 2 give the same losses bit for bit")
    check(same("bf16-all/z2", "bf16-all/z3"), "bf16-all: stages 2 and 3 give the same losses bit for bit")
    check(same("fp16-master/z2+off", "fp16-master/z3+off"),
          "fp16-master with offload: stages 2 and 3 give the same losses bit for bit")
    check(same("bf16/z2", "bf16/z2+off"), "bf16: CPU offload gives the same losses bit for bit")
    check(same("fp16-master/z2", "fp16-master/z2+off"), "fp16-master: CPU offload gives the same losses bit for bit")
    check(not same("bf16-all/z2", "bf16-all-sr/z2"), "stochastic rounding changes the losses")
    check(not same("fp32/z0", "fp32-ac/z0"), "autocast changes fp32's losses (bf16 matrix products)")
    gap = max(abs(x - y) for x, y in zip(runs["fp32/z0"]["train_loss"], runs["torch"]["train_loss"]))
    gap = max(gap, abs(runs["fp32/z0"]["eval_loss"] - runs["torch"]["eval_loss"]))
    check(gap < 1e-4, "fp32/z0 follows LibTorch's AdamW step for step (largest loss difference %.2g)" % gap)
    blog = {e["id"]: e for e in res["blog_comparison"]}
    check(sorted(blog) == ["bf16-all-ac/z2", "bf16-all-sr/z2", "bf16-all/z2"],
          "blog comparison rows (got %s)" % sorted(blog))
    base = runs["bf16/z2"]
    for cid, e in blog.items():
        r = runs[cid]
        mem = (r["measured_device_bytes"] + r["measured_host_bytes"]) / (
            base["measured_device_bytes"] + base["measured_host_bytes"]) - 1
        ok = (e["baseline"] == "bf16/z2" and abs(e["memory_change"] - mem) < 1e-12
              and e["memory_target_met"] == (mem <= -0.45)
              and abs(e["step_time_change"] - (base["steps_per_s"] / r["steps_per_s"] - 1)) < 1e-12
              and abs(e["eval_change_vs_baseline"] - (r["eval_loss"] / base["eval_loss"] - 1)) < 1e-12)
        check(ok, "blog comparison of %s agrees with its rows (memory %+.1f%%)" % (cid, 100 * mem))
        sr = "-sr" in cid
        check(("eval_change_vs_fp32" in e) == sr, "%s: the fp32 loss criterion %s" % (cid, "present" if sr else "absent"))
    bf16_all, fp32 = runs["bf16-all/z2"], runs["fp32/z0"]
    check(bf16_all["measured_bytes_per_param"] < fp32["measured_bytes_per_param"],
          "bf16-all holds fewer bytes per parameter than fp32")

    check_saved(runs, saved, a.world)
    check_memory_by_world(out, runs, a.world)

    print("%d check(s) failed" % len(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
