#!/usr/bin/env python3
"""Checks bench/peers_render.py and the results format of bench/peers.py on a made-up
result file (CTest bench.peers_render): the ratio cells, the notes and reasons of peers
that ran another way or not at all, markdown escaping, the plot, the format's checks on
bad files, and peers.py's helpers that need no torch (tensor sizes of the multi layout,
size parsing, per-round ratios). Needs neither torch nor deepspeed; the plot is checked
when matplotlib is installed."""
import copy
import json
import os
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import peers  # noqa: E402 (stdlib only at import: torch is imported by peers.main())
import peers_render  # noqa: E402

script = os.path.join(here, "peers_render.py")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(*args):
    p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def timed(how, median_s, lo, med, hi, note=None):
    return {"status": "timed", "how": how, "note": note, "reason": None, "check": {"ok": True, "items": []},
            "median_s": median_s, "times_s": [median_s], "ratios": [lo, med, hi], "ratio_median": med,
            "ratio_min": lo, "ratio_max": hi}


def not_run(status, reason):
    return {"status": status, "how": None, "note": None, "reason": reason, "check": None}


SR_NOTE = "torch 2.11.0 has no stochastic rounding; compared against its nearest-rounding bf16 step"
DIFFERS = "DeepSpeedCPUAdam differs from mpzero after one step from the same inputs: param 3 ulp (limit 1) FAILED"
UNSUPPORTED = "torch.optim.AdamW keeps its states in the parameter's dtype | bf16 with fp32 states"
UNAVAILABLE = "DeepSpeedCPUAdam: deepspeed is not installed"
SKIPPED = "DeepSpeedCPUAdam compiles per shape; the benchmark runs it on the single-tensor rows only"
doc = {
    "format": "mpzero-peers/1",
    "environment": {"cpu_model": "Test CPU 9000", "threads": 2, "torch": "2.11.0", "deepspeed": None,
                    "mpzero_commit": "abc123", "mpzero_host_simd": "avx512", "python": "3.11.7",
                    "loadavg_before": [0.1, 0.2, 0.3], "loadavg_after": [0.4, 0.5, 0.6]},
    "hyperparameters": {"lr": 1e-3}, "threads": 2, "rounds": 3, "warmup": 2,
    "peers": [{"name": "DeepSpeedCPUAdam", "available": True, "version": "0.19.8", "reason": None},
              {"name": "torch fused", "available": True, "version": "2.11.0", "reason": None}],
    "results": [
        {"config": "fp32", "numel": 1 << 20, "layout": "single", "tensors": 1,
         "mpzero": {"status": "timed", "median_s": 1e-3, "times_s": [1e-3]},
         "peers": {"DeepSpeedCPUAdam": timed("native", 1.2e-3, 1.1, 1.2, 1.3),
                   "torch fused": timed("native", 2e-3, 1.5, 2.0, 2.5)}},
        {"config": "bf16_all_sr", "numel": 1 << 20, "layout": "multi", "tensors": 200,
         "mpzero": {"status": "timed", "median_s": 5e-4, "times_s": [5e-4],
                    "nearest": {"median_s": 4e-4, "times_s": [4e-4], "ratios": [1.1, 1.25, 1.4],
                                "ratio_median": 1.25, "ratio_min": 1.1, "ratio_max": 1.4}},
         "peers": {"DeepSpeedCPUAdam": not_run("differs", DIFFERS),
                   "torch fused": timed("substitute", 1e-3, 1.75, 2.0, 3.125, note=SR_NOTE)}},
        {"config": "bf16_all", "numel": 1 << 20, "layout": "multi", "tensors": 200,
         "mpzero": {"status": "timed", "median_s": 4e-4, "times_s": [4e-4]},
         "peers": {"DeepSpeedCPUAdam": not_run("skipped", SKIPPED),
                   "torch fused": timed("native", 8e-4, 1.5, 2.0, 2.5)}},
        {"config": "bf16_master_fp32_states", "numel": 16 << 20, "layout": "single", "tensors": 1,
         "mpzero": {"status": "timed", "median_s": 0.01, "times_s": [0.01]},
         "peers": {"DeepSpeedCPUAdam": not_run("unavailable", UNAVAILABLE),
                   "torch fused": not_run("unsupported", UNSUPPORTED)}},
    ],
}

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "peers.json")

    def write(d):
        with open(path, "w") as f:
            if isinstance(d, str):
                f.write(d)
            else:
                json.dump(d, f)

    write(doc)
    rc, out, err = run(path, "--markdown")
    lines = out.splitlines()
    check(rc == 0, f"--markdown: exit status {rc}, stderr {err!r}")
    check("| config | elements | layout | mpzero ms | DeepSpeedCPUAdam | torch fused | fastest same update |" in lines,
          f"markdown header (no copy column: no row has a copy baseline): {out!r}")
    check("| fp32 | 1M | 1 tensor | 1.000 | 1.20 (1.10–1.30) | 2.00 (1.50–2.50) | 1.20 DeepSpeedCPUAdam |" in lines,
          f"fp32 row: {out!r}")
    # A substitute computes another update: not the fastest of the same update.
    check("| bf16_all_sr | 1M | 200 tensors | 0.500 | differs [1] | 2.00 (1.75–3.12) [2] | none timed |" in lines,
          f"substitute and differs row: {out!r}")
    check("| bf16_all | 1M | 200 tensors | 0.400 | skipped [3] | 2.00 (1.50–2.50) | 2.00 torch fused |" in lines,
          f"a skipped peer: {out!r}")
    check("| bf16_master_fp32_states | 16M | 1 tensor | 10.000 | unavailable [4] | unsupported [5] | none timed |"
          in lines,
          f"rows of peers that did not run: {out!r}")
    check("mpzero's stochastic rounding over its nearest rounding, the same tensors in the same rounds "
          "(bf16_all_sr / bf16_all, median (min-max) over the rounds): 1M 200 tensors 1.25 (1.10–1.40)" in lines,
          f"the SR line: {out!r}")
    check(any(l.startswith("[1] " + DIFFERS) for l in lines), "note [1]: the differs reason")
    check(any(l.startswith("[2] " + SR_NOTE) for l in lines), "note [2]: the substitute's note")
    check(any(l.startswith("[5] ") and "dtype \\| bf16" in l for l in lines), f"'|' escaped in markdown: {out!r}")
    check("Test CPU 9000" in out and "peer time / mpzero time" in out and "3 rounds" in out,
          f"summary line: {lines[:1]!r}")

    rc, out, err = run(path)
    check(rc == 0 and "2.00 (1.50-2.50)" in out and "[4] " + UNAVAILABLE in out and "|" not in out.split("\n[")[0]
          .split("\n", 1)[1], f"text table: rc {rc}: {out!r} {err!r}")

    png = os.path.join(tmp, "ratios.png")
    try:
        import matplotlib  # noqa: F401
        have_mpl = True
    except ImportError:
        have_mpl = False
    rc, out, err = run(path, "--plot", png)
    if have_mpl:
        ok = rc == 0 and os.path.exists(png)
        if ok:
            with open(png, "rb") as f:
                ok = f.read(8) == b"\x89PNG\r\n\x1a\n"
        check(ok, f"--plot: rc {rc}, {err!r}")
    else:
        check(rc != 0 and "matplotlib" in err, f"--plot without matplotlib: rc {rc}, {err!r}")

    # Files that do not fit the format: a non-zero exit and a message that says what is wrong.
    def bad(mutate, expect, what):
        d = copy.deepcopy(doc)
        mutate(d)
        write(d)
        rc, out, err = run(path)
        check(rc != 0 and expect in err, f"{what}: rc {rc}, stderr {err!r}")

    bad(lambda d: d.update(format="mpzero-peers/0"), "format is", "wrong format")
    bad(lambda d: d.pop("results"), "missing 'results'", "no results")
    bad(lambda d: d["results"][0]["peers"]["torch fused"].pop("ratio_median"), "missing 'ratio_median'",
        "timed without a ratio")
    bad(lambda d: d["results"][0]["peers"]["torch fused"].update(ratio_min=3.0), "does not hold",
        "min above the median")
    bad(lambda d: d["results"][1]["peers"]["DeepSpeedCPUAdam"].update(reason=None), "needs a reason",
        "differs without a reason")
    bad(lambda d: d["results"][0]["peers"].update({"Adam9": d["results"][0]["peers"]["torch fused"]}),
        "not listed in 'peers'", "a peer missing from the list")
    bad(lambda d: d["results"][0].update(layout="both"), "neither", "unknown layout")
    bad(lambda d: d["results"][0]["mpzero"].update(median_s=True), "expected int or float", "a bool as a time")
    bad(lambda d: d["results"][0]["peers"]["torch fused"].update(status="postponed"), "is not one of",
        "unknown status")
    write("{not json")
    rc, out, err = run(path)
    check(rc != 0 and "is not JSON" in err, f"bad JSON: rc {rc}, {err!r}")
    rc, out, err = run(os.path.join(tmp, "absent.json"))
    check(rc != 0 and "cannot read" in err and "absent.json" in err, f"absent file: rc {rc}, {err!r}")

# A GPU run: the device's summary, the copy column, a reference peer (another update: never
# the fastest of the same update) and a composite.
REF_NOTE = "bitsandbytes AdamW8bit keeps 8-bit states: another update, not compared"
gpu = copy.deepcopy(doc)
gpu["environment"].update(device="cuda", gpu="NVIDIA Test GPU", mpzero_cuda_archs="900", te=None, bnb="0.50.2",
                          nvidia_smi_before={"driver_version": "580.1", "clocks.sm": "1980 MHz",
                                             "clocks.max.sm": "1980 MHz"})
gpu["peers"] = [{"name": "DeepSpeed FusedAdam", "available": True, "version": "0.19.8", "reason": None},
                {"name": "bitsandbytes AdamW8bit", "available": True, "version": "0.50.2", "reason": None}]
gpu["results"] = [
    {"config": "bf16_fp32_master", "numel": 16 << 20, "layout": "single", "tensors": 1,
     "copy": {"bytes": 28 * (16 << 20), "median_s": 9e-5, "times_s": [9e-5], "ratios": [0.88, 0.9, 0.95],
              "ratio_median": 0.9, "ratio_min": 0.88, "ratio_max": 0.95},
     "mpzero": {"status": "timed", "median_s": 1e-4, "times_s": [1e-4]},
     "peers": {"DeepSpeed FusedAdam": timed("composite", 1.6e-4, 1.5, 1.6, 1.7, note="composite"),
               "bitsandbytes AdamW8bit": timed("reference", 0.9e-4, 0.85, 0.9, 0.95, note=REF_NOTE)}},
    {"config": "fp32", "numel": 1 << 20, "layout": "single", "tensors": 1,
     "mpzero": {"status": "timed", "median_s": 1e-5, "times_s": [1e-5]},
     "peers": {"DeepSpeed FusedAdam": timed("native", 1.2e-5, 1.1, 1.2, 1.3),
               "bitsandbytes AdamW8bit": not_run("error", "bitsandbytes failed: no GPU library")}},
]
text = peers_render.render(peers_render.validate(copy.deepcopy(gpu)), markdown=True)
gl = text.splitlines()
check(gl[0].startswith("NVIDIA Test GPU (driver 580.1, SM clock 1980 MHz of 1980 MHz before)") and "CUDA events" in gl[0]
      and "bitsandbytes 0.50.2" in gl[0], f"GPU summary: {gl[0]!r}")
check("| config | elements | layout | mpzero ms | % of copy | DeepSpeed FusedAdam | bitsandbytes AdamW8bit | "
      "fastest same update |" in gl, f"GPU header: {text!r}")
check("| bf16_fp32_master | 16M | 1 tensor | 0.100 | 90.0% (88.0%–95.0%) | 1.60 (1.50–1.70) [1] | 0.90 (0.85–0.95) [2] "
      "| 1.60 DeepSpeed FusedAdam |" in gl, f"GPU row with copy and a reference: {text!r}")
check("| fp32 | 1M | 1 tensor | 0.010 |  | 1.20 (1.10–1.30) | error [3] | 1.20 DeepSpeed FusedAdam |" in gl,
      f"GPU row without copy: {text!r}")


def rejected(base, mutate, expect, what):
    """validate() refuses `base` changed by `mutate`, with a message that contains `expect`."""
    d = copy.deepcopy(base)
    mutate(d)
    try:
        peers_render.validate(d)
        check(False, f"validate() accepts {what}")
    except peers_render.FormatError as e:
        check(expect in str(e), f"{what}: the message names {expect!r}: {e}")


rejected(gpu, lambda d: d["results"][0]["copy"].update(ratio_min=0.99), "copy", "a copy ratio_min above its median")
rejected(gpu, lambda d: d["results"][0]["peers"]["bitsandbytes AdamW8bit"].update(how="approximate"), "approximate",
         "an unknown how")

# A run stopped early (peers.py rewrites its file after every row) says so above the table.
partial = copy.deepcopy(doc)
partial["complete"] = False
text = peers_render.render(peers_render.validate(partial))
check(text.startswith("Partial results: the run stopped after 4 row(s).\n"), f"partial run: {text[:120]!r}")
check(not peers_render.render(peers_render.validate(dict(copy.deepcopy(doc), complete=True))).startswith("Partial"),
      "a complete run is not called partial")
rejected(doc, lambda d: d.update(complete="no"), "complete", "a string as complete")
partial["not_run"] = [{"config": "fp16_fp32_master", "numel": 1 << 20, "layout": "multi"}]
text = peers_render.render(peers_render.validate(partial))
check(text.startswith("Partial results: the run stopped after 4 row(s). Not started: fp16_fp32_master 1M multi.\n"),
      f"rows a time limit kept from starting: {text[:160]!r}")
rejected(partial, lambda d: d["not_run"][0].pop("numel"), "numel", "a row not run without its size")

# validate() is what peers.py runs on its own output before writing it.
try:
    peers_render.validate(copy.deepcopy(doc))
except peers_render.FormatError as e:
    check(False, f"validate() rejects the fixture: {e}")

# peers.py's helpers.
sizes = peers.mixed_sizes(1 << 20, 200, 7)
check(len(sizes) == 200 and sum(sizes) == 1 << 20 and min(sizes) >= 1, f"mixed_sizes: {len(sizes)}, {sum(sizes)}")
check(sizes == peers.mixed_sizes(1 << 20, 200, 7), "mixed_sizes is not deterministic")
check(sizes != peers.mixed_sizes(1 << 20, 200, 8), "mixed_sizes ignores its seed")
check(max(sizes) > 100 * min(sizes), f"mixed_sizes spans less than two decades: {min(sizes)}..{max(sizes)}")
small = peers.mixed_sizes(300, 200, 1)
check(len(small) == 200 and sum(small) == 300 and min(small) >= 1, f"mixed_sizes of 300 into 200: {small}")
check(peers.parse_size("64K") == 65536 and peers.parse_size("1M") == 1 << 20 and peers.parse_size("1000") == 1000,
      "parse_size")
try:
    peers.parse_size("1.5M")
    check(False, "parse_size accepts 1.5M")
except ValueError:
    pass
r = peers.ratio_summary([2.0, 4.0, 3.0], [1.0, 2.0, 1.0])
check(r["ratios"] == [2.0, 2.0, 3.0] and r["ratio_median"] == 2.0 and r["ratio_min"] == 2.0 and
      r["ratio_max"] == 3.0, f"ratio_summary: {r}")
check(peers.rotated(["a", "b", "c"], 4) == ["b", "c", "a"], "rotated")
# Bytes a step reads and writes per element, from the definition: param and master read and
# written, gradient read, two states read and written.
check(peers.step_bytes("fp32") == 4 + 4 + 4 + 16 and peers.step_bytes("bf16_fp32_master") == 4 + 8 + 2 + 16
      and peers.step_bytes("bf16_all") == 4 + 2 + 8 and peers.step_bytes("bf16_master_fp32_states") == 4 + 2 + 16,
      "step_bytes")
check(peers.peer_ids_for("cpu") == ["deepspeed", "fused", "foreach", "forloop", "torchao"] and
      peers.peer_ids_for("cuda") == ["deepspeed", "fused", "foreach", "forloop", "torchao", "te", "bnb"],
      f"peer_ids_for: {peers.peer_ids_for('cpu')}, {peers.peer_ids_for('cuda')}")
check(peers.peer_name("deepspeed", "cpu") == "DeepSpeedCPUAdam" and
      peers.peer_name("deepspeed", "cuda") == "DeepSpeed FusedAdam", "peer_name")
check(peers.HPARAMS["beta2"] == peers.as_float32(peers.HPARAMS["beta2"]) and abs(peers.HPARAMS["beta2"] - 0.999) < 1e-7,
      "hyperparameters must be float32 values")

if failures:
    print("test_peers_render: FAILED\n  " + "\n  ".join(failures))
    sys.exit(1)
print("test_peers_render: all checks passed")
