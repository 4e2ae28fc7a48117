#!/usr/bin/env python3
"""bench/peers.py's --device cuda path, run on a machine without a GPU: what it does
around the GPU (the peers' plans and state injection, the event timing behind the spin
kernel, the recorded environment, the results file) is checked here, so that a GPU run
does not stop on it.

What stands in for what:
  - torch.cuda's calls that need a device (events, synchronize, the spin kernel, device
    properties) are replaced by host versions; tensors asked for on "cuda" are made on
    the CPU;
  - the host step library (libmpzero_peers_step.so, argv[1]) stands in for the CUDA one,
    with the CUDA library's extra functions added;
  - TransformerEngine's FusedAdam and bitsandbytes' AdamW8bit are small classes with their
    interfaces (TE: initialize_state, the step count in the parameter group, the fp32
    master in the "master_param" state, states computed in fp32 and stored in their
    dtype; bitsandbytes: states of its own).
The GPU numbers themselves mean nothing here; the test checks the path, not the speed.

  python3 bench/test_peers_gpu_path.py build/bench/libmpzero_peers_step.so
"""
import json
import os
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


if len(sys.argv) != 2:
    sys.exit("usage: test_peers_gpu_path.py LIBMPZERO_PEERS_STEP_SO")
LIB = sys.argv[1]

import torch  # noqa: E402

import peers  # noqa: E402
import peers_render  # noqa: E402


# ---- tensors on "cuda" made on the CPU ------------------------------------------------------

def _host(kw):
    if str(kw.get("device", "")).startswith("cuda"):
        kw["device"] = "cpu"
    return kw


for _name in ("empty", "zeros", "full", "empty_like"):
    _f = getattr(torch, _name)
    setattr(torch, _name, (lambda f: lambda *a, **kw: f(*a, **_host(kw)))(_f))
_to = torch.Tensor.to
torch.Tensor.to = lambda self, *a, **kw: _to(self, *a, **_host(kw))


# ---- torch.cuda without a device --------------------------------------------------------------

calls = {"record": 0, "sleep": [], "synchronize": 0}


class Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        calls["record"] += 1
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def _synchronize(*a):
    calls["synchronize"] += 1


props = types.SimpleNamespace(name="Stand-in GPU", major=9, minor=0, total_memory=80 << 30, multi_processor_count=132)
torch.cuda.is_available = lambda: True
torch.cuda.init = lambda: None
torch.cuda.current_stream = lambda: types.SimpleNamespace(cuda_stream=0)
torch.cuda.get_device_properties = lambda i: props
torch.cuda.get_device_capability = lambda *a: (9, 0)
torch.cuda.Event = Event
torch.cuda.synchronize = _synchronize
torch.cuda._sleep = lambda cycles: calls["sleep"].append(cycles)
torch.cuda.empty_cache = lambda: None
torch.cuda.is_current_stream_capturing = lambda: False  # torch.optim asks when CUDA is "available"

stream_set = []
_load = peers.load_library


def load_standin(path, device):
    lib = _load(path, "cpu")
    lib.mpzero_peers_cuda_archs = lambda: b"900"
    lib.mpzero_peers_cuda_runtime = lambda: 13000
    lib.mpzero_peers_set_stream = lambda s: stream_set.append(s)
    return lib


peers.load_library = load_standin
smi = {"name": "Stand-in GPU", "driver_version": "580.0", "clocks.sm": "1980 MHz", "clocks.max.sm": "1980 MHz",
       "clocks.mem": "3201 MHz", "temperature.gpu": "40", "power.draw": "100 W"}
peers.nvidia_smi = lambda: dict(smi)


# ---- TransformerEngine and bitsandbytes stand-ins ---------------------------------------------

class TEFusedAdam(torch.optim.Optimizer):
    """TransformerEngine's FusedAdam interface: states made by initialize_state (with a
    scale per state), the step count in the group, an fp32 master in "master_param" with
    master_weights=True; the update in fp32, stored in each state's dtype."""

    def __init__(self, params, lr, betas, eps, weight_decay, bias_correction=True, adam_w_mode=True,
                 master_weights=False, master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                 exp_avg_sq_dtype=torch.float32):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        assert bias_correction and adam_w_mode
        self.master_weights, self.dtypes, self._scales = master_weights, (exp_avg_dtype, exp_avg_sq_dtype), {}

    def initialize_state(self, p, store_param_remainders):
        self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=self.dtypes[0])
        self.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=self.dtypes[1])
        if self.master_weights:
            self.state[p]["master_param"] = p.detach().float()
        self._scales[p] = {"exp_avg": torch.ones(1), "exp_avg_sq": torch.ones(1)}

    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t = group["betas"], group["step"]
            for p in group["params"]:
                st = self.state[p]
                assert p in self._scales, "initialize_state was not called"
                m, v = st["exp_avg"].float(), st["exp_avg_sq"].float()
                w = st["master_param"] if self.master_weights else p.detach().float()
                g = p.grad.float()
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                w.mul_(1 - group["lr"] * group["weight_decay"])
                w.addcdiv_(m / (1 - b1 ** t), (v / (1 - b2 ** t)).sqrt().add_(group["eps"]), value=-group["lr"])
                st["exp_avg"].copy_(m)
                st["exp_avg_sq"].copy_(v)
                p.data.copy_(w)


te = types.ModuleType("transformer_engine")
te.__version__ = "stand-in"
te.pytorch = types.ModuleType("transformer_engine.pytorch")
te.pytorch.optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
te.pytorch.optimizers.FusedAdam = TEFusedAdam
bnb = types.ModuleType("bitsandbytes")
bnb.__version__ = "stand-in"
bnb.optim = types.SimpleNamespace(AdamW8bit=lambda params, **kw: torch.optim.AdamW(params, foreach=False, **kw))
sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch,
                    "transformer_engine.pytorch.optimizers": te.pytorch.optimizers, "bitsandbytes": bnb})


# ---- the run ------------------------------------------------------------------------------------

CONFIGS = ("fp32", "bf16_fp32_master", "bf16_all_sr")
with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "peers_cuda.json")
    sys.argv = ["peers.py", "--device", "cuda", "--lib", LIB, "--quick", "--sizes", "4096", "--tensors", "8",
                "--configs", ",".join(CONFIGS), "--peers", "fused,forloop,te,bnb", "--out", out]
    peers.main()
    with open(out) as f:
        doc = peers_render.validate(json.load(f))

env = doc["environment"]
check(env["device"] == "cuda" and env["gpu"] == "Stand-in GPU" and env["gpu_capability"] == "9.0" and
      env["gpu_sms"] == 132, f"the GPU recorded: {env.get('gpu')}, {env.get('gpu_capability')}, {env.get('gpu_sms')}")
check(env["mpzero_cuda_archs"] == "900" and env["mpzero_cuda_runtime"] == "13.0",
      f"mpzero's CUDA build recorded: {env.get('mpzero_cuda_archs')}, {env.get('mpzero_cuda_runtime')}")
check(env["nvidia_smi_before"] == smi and env["nvidia_smi_after"] == smi, "nvidia-smi before and after")
check(env["te"] == "stand-in" and env["bnb"] == "stand-in", f"peer versions: {env.get('te')}, {env.get('bnb')}")
check("mpzero_host_simd" not in env and "huge_pages" not in env, "host-only fields on a GPU run")
check(len(stream_set) == 1 and not stream_set[0].value, f"the step library was given torch's stream once: {stream_set}")
check(doc["complete"] is True and len(doc["results"]) == 2 * len(CONFIGS), f"rows: {len(doc['results'])}")
# Each row: every contender timed in each round behind one spin, with two events.
timed_steps = sum(1 + ("nearest" in r["mpzero"]) + 1 + sum(e["status"] == "timed" for e in r["peers"].values())
                  for r in doc["results"]) * doc["rounds"]
check(calls["sleep"] and set(calls["sleep"]) == {peers.SPIN_CYCLES} and len(calls["sleep"]) == timed_steps,
      f"spin kernels: {len(calls['sleep'])} for {timed_steps} timed steps")
check(calls["record"] == 2 * timed_steps, f"events recorded: {calls['record']} for {timed_steps} timed steps")

for r in doc["results"]:
    w = f"{r['config']} {r['layout']}"
    check(r["copy"]["bytes"] == peers.step_bytes(r["config"]) * r["numel"] // 2 * 2,
          f"{w}: the copy baseline moves the step's bytes: {r['copy']['bytes']}")
    p = r["peers"]
    for name in ("torch fused", "torch for-loop"):
        want = {"fp32": "native", "bf16_fp32_master": "composite", "bf16_all_sr": "substitute"}[r["config"]]
        check(p[name]["status"] == "timed" and p[name]["how"] == want and p[name]["check"]["ok"],
              f"{w}: {name} {p[name]['status']} {p[name].get('how')} ({p[name].get('reason')})")
    e = p["TE FusedAdam"]
    want = "substitute" if r["config"] == "bf16_all_sr" else "native"
    check(e["status"] == "timed" and e["how"] == want and e["check"]["ok"],
          f"{w}: TE {e['status']} {e.get('how')} ({e.get('reason')})")
    if r["config"] == "bf16_fp32_master":
        check("master_weights=True" in (e["note"] or ""), f"{w}: TE's note names its own master: {e['note']}")
    e = p["bitsandbytes AdamW8bit"]
    check(e["status"] == "timed" and e["how"] == "reference" and e["check"] is None and "not compared" in e["note"],
          f"{w}: bitsandbytes {e['status']} {e.get('how')} ({e.get('reason')})")
    # Substitutes and references compute other updates: with stochastic rounding, no peer here
    # computes mpzero's; otherwise the fastest is one of the three that do.
    best = peers_render.fastest_same_update(r)
    if r["config"] == "bf16_all_sr":
        check(best is None, f"{w}: no peer computes stochastic rounding here, yet the fastest is {best}")
    else:
        check(best is not None and best[0] in ("torch fused", "torch for-loop", "TE FusedAdam"),
              f"{w}: the fastest same update: {best}")

text = peers_render.render(doc, markdown=True)
check(text.startswith("Stand-in GPU (driver 580.0") and "% of copy" in text and "fastest same update" in text,
      f"rendered GPU table: {text[:200]!r}")

if failures:
    print("test_peers_gpu_path: FAILED\n  " + "\n  ".join(failures))
    sys.exit(1)
print("test_peers_gpu_path: all checks passed")
