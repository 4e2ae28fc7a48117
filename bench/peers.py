#!/usr/bin/env python3
"""mpzero's AdamW step against its peers, side by side in one process over the same
tensors, on the CPU (--device cpu, the default) or a CUDA GPU (--device cuda).

CPU: DeepSpeed's DeepSpeedCPUAdam, torch.optim.AdamW (fused=True, foreach=True and the
for-loop) and torchao's AdamW (torchao.optim._AdamW, compiled by torch.compile; with bf16
stochastic rounding where mpzero rounds stochastically), with mpzero's host step
(mpzero::host::run, optim::adamw) called through bench/peers_step.cpp's C functions
(libmpzero_peers_step.so, ctypes).
GPU: torch.optim.AdamW (fused, foreach, for-loop), DeepSpeed's FusedAdam (its fused_adam
op built on first use), torchao's AdamW, TransformerEngine's FusedAdam (natively with
its fp32 master and state dtypes) and bitsandbytes' AdamW8bit (a reference: 8-bit states,
another update), with mpzero's CUDA step (cuda::fused_step_launcher) called through
bench/peers_step_cuda.cu's (libmpzero_peers_step_cuda.so) on torch's current stream.

Every contender steps the very same tensors (mpzero gets their data_ptr()), with the same
hyperparameters (AdamW: lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01, each as
its nearest float32 value because DeepSpeedCPUAdam keeps them in float32; bias
correction; first step 10) and the same OpenMP thread count (torch.set_num_threads and
OMP_NUM_THREADS agree; mpzero is given the count; all run on the one OpenMP runtime loaded
into the process).

Configurations (mpzero's policy names):
  fp32                     fp32 params, grads, states
  bf16_fp32_master         bf16 params and grads, fp32 master and states
  bf16_master_fp32_states  bf16 params (the master) and grads, fp32 states
  bf16_all                 bf16 everything, nearest rounding
  bf16_all_sr              bf16 everything, stochastic rounding
  fp16_fp32_master         fp16 params and grads, fp32 master and states
A peer runs a configuration natively, as a composite (a 16-bit model with fp32 masters the
way its users train one: the 16-bit gradient copied into an fp32 buffer, the fp32 master
stepped, the master copied into the 16-bit parameter), as a substitute (no stochastic
rounding: its nearest-rounding bf16 step), or not at all; every row says which, and why.

Layouts: "single" (one tensor of n elements) and "multi" (--tensors tensors of
log-uniform sizes over three decades, fixed seed, summing to n, each its own allocation).

Correctness first: before timing, every contender takes one step (step 10) from identical
inputs and its results are compared with mpzero's: fp32 values to 1e-6 relative (the
states to 1e-5), 16-bit values within 1 ulp (stochastic rounding against a peer's nearest
rounding too). A peer that disagrees is marked "differs" and not timed.

Timing: --warmup steps of each contender, then --rounds rounds; each round runs every
contender once, in an order that rotates from round to round, timed with
time.perf_counter around the step call (CPU) or with CUDA events behind a spin kernel that
holds the stream while the step is enqueued (GPU). Reported: each contender's median time
and, per peer, the ratio peer time / mpzero time of each round (above 1: mpzero is
faster), with the median and the min-max over the rounds; and mpzero's share of copy
bandwidth: torch's copy_ of the step's volume, timed in the same rounds.

  python3 bench/peers.py [--device cpu|cuda] [--lib PATH]
      [--sizes 1M,16M,64M] [--configs fp32,bf16_all,...] [--layouts single,multi]
      [--peers deepspeed,fused,foreach,forloop,torchao,te,bnb] [--rounds 15] [--threads N]
      [--quick] [--huge-pages] [--out results.json]
  python3 bench/peers_render.py results.json [--markdown] [--plot ratios.png]

DeepSpeed is optional:  DS_BUILD_OPS=0 python3 -m pip install deepspeed  (its cpu_adam op
is built on first use with ninja and g++, about a minute). So is torchao:
python3 -m pip install torchao (its step compiles on first use, about half a minute, and
again for every tensor shape, so it runs on the single-tensor rows only). Without them
the other peers run.
"""
import argparse
import ctypes
import datetime
import gc
import math
import os
import platform
import random
import re
import statistics
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import peers_render  # noqa: E402 (beside this script: the results' format, its table and sizes' names)
from peers_render import fmt_size  # noqa: E402
FORMAT = "mpzero-peers/1"
DEEPSPEED_PIP = "DS_BUILD_OPS=0 python3 -m pip install deepspeed"
TORCHAO_PIP = "python3 -m pip install torchao"
TE_PIP = "python3 -m pip install --no-build-isolation transformer_engine[pytorch]"
BNB_PIP = "python3 -m pip install bitsandbytes"



def as_float32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


# The hyperparameters of every contender: bench_common.hpp's bench_options<optim::adamw>()
# (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01), each as the float32 value
# nearest to it. DeepSpeedCPUAdam keeps them in float32, torch and mpzero's preparation in
# double: from float32 values all start from the same numbers. (From 0.999 itself,
# DeepSpeed's 1 - beta2^10 is off by 1.3e-5 relative, and its parameters by 2e-6 after one
# step; from float32(0.999), by 2e-7.)
HPARAMS = {"lr": as_float32(1e-3), "beta1": as_float32(0.9), "beta2": as_float32(0.999), "eps": as_float32(1e-8),
           "weight_decay": as_float32(0.01), "adamw": True, "bias_correction": True, "first_step": 10,
           "seed": 0x5EED}

# config: (param, master or None when the param is the master, grad, state, stochastic rounding)
CONFIGS = {
    "fp32": ("fp32", None, "fp32", "fp32", False),
    "bf16_fp32_master": ("bf16", "fp32", "bf16", "fp32", False),
    "bf16_master_fp32_states": ("bf16", None, "bf16", "fp32", False),
    "bf16_all": ("bf16", None, "bf16", "bf16", False),
    "bf16_all_sr": ("bf16", None, "bf16", "bf16", True),
    "fp16_fp32_master": ("fp16", "fp32", "fp16", "fp32", False),
}
PEERS = {  # --peers id: display name on the CPU, on a CUDA device (None: not a peer there)
    "deepspeed": ("DeepSpeedCPUAdam", "DeepSpeed FusedAdam"),
    "fused": ("torch fused", "torch fused"),
    "foreach": ("torch foreach", "torch foreach"),
    "forloop": ("torch for-loop", "torch for-loop"),
    "torchao": ("torchao AdamW", "torchao AdamW"),
    "te": (None, "TE FusedAdam"),
    "bnb": (None, "bitsandbytes AdamW8bit"),
}
DEVICES = ("cpu", "cuda")
LAYOUTS = ("single", "multi")
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# The value ranges of bench_common.hpp's fills: params (and masters), gradients, moments.
FILL = {"param": (-1.0, 1.0), "grad": (-1e-2, 1e-2), "exp_avg": (-1e-3, 1e-3), "exp_avg_sq": (0.0, 1e-4)}
# Tolerances of the start-up check: (fp32 relative, floor), and the floor below which a
# 16-bit difference counts in ulps of the floor (values near zero, where one rounding of
# a tiny result may cross it).
TOL_FP32 = {"param": (1e-6, 1e-3), "master": (1e-6, 1e-3), "exp_avg": (1e-5, 1e-4), "exp_avg_sq": (1e-5, 1e-6)}
FLOOR_16 = {"param": 1e-3, "master": 1e-3, "exp_avg": 1e-4, "exp_avg_sq": 1e-6}
MANTISSA_BITS = {"bf16": 7, "fp16": 10}


# ---- pure helpers (no torch: bench/test_peers_render.py imports them) ----------------------

def parse_size(s):
    """'1M' -> 1048576, '64K' -> 65536, '1000' -> 1000."""
    s = s.strip()
    m = re.fullmatch(r"(\d+)([KkMmGg]?)", s)
    if not m:
        raise ValueError(f"not a size: {s!r} (use e.g. 1M, 64K or 1000)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]


def mixed_sizes(total, count, seed):
    """`count` tensor sizes summing to `total`, log-uniform over three decades, from a fixed
    seed (the same list on every machine and Python version); each at least 1."""
    count = max(1, min(count, total))
    rng = random.Random(seed)
    w = [math.exp(rng.uniform(0.0, math.log(1000.0))) for _ in range(count)]
    scale = (total - count) / sum(w)
    sizes = [1 + int(x * scale) for x in w]
    sizes[max(range(count), key=w.__getitem__)] += total - sum(sizes)
    return sizes


def ratio_summary(peer_times, mpzero_times):
    """Per-round ratios peer / mpzero, their median, min and max."""
    ratios = [p / m for p, m in zip(peer_times, mpzero_times)]
    return {"ratios": ratios, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


def rotated(items, r):
    k = r % len(items)
    return items[k:] + items[:k]


def peer_ids_for(device):
    """The --peers ids that are peers on `device`, in PEERS' order."""
    return [pid for pid, names in PEERS.items() if names[DEVICES.index(device)] is not None]


def peer_name(pid, device):
    return PEERS[pid][DEVICES.index(device)]


def step_bytes(config):
    """Bytes a step of one element reads and writes: the parameter, the master and the two
    states read and written, the gradient read."""
    p, m, g, s, _ = CONFIGS[config]
    return 2 * BYTES[p] + (2 * BYTES[m] if m else 0) + BYTES[g] + 4 * BYTES[s]


# ---- environment ---------------------------------------------------------------------------

def repo_relative(path):
    """path relative to the repository when it lies inside it (results carry no machine's
    directories), else absolute."""
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO) if full.startswith(os.path.abspath(REPO) + os.sep) else full


def thp_mode():
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), or None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            m = re.search(r"\[(\w+)\]", f.read())
        return m.group(1) if m else None
    except OSError:
        return None


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit():
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def openmp_runtimes():
    """The OpenMP runtimes mapped into this process: one means every contender shares it."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if re.search(r"lib(gomp|iomp5|omp)[^/]*\.so", os.path.basename(path)):
                    found.add(os.path.realpath(path))
    except OSError:
        pass
    return sorted(found)


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# ---- mpzero through ctypes -----------------------------------------------------------------

class Hparams(ctypes.Structure):
    """bench/peers_step.cpp's mpzero_peers_hparams."""
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double), ("seed", ctypes.c_uint64)]


def load_library(path, device):
    lib = ctypes.CDLL(path)
    vp, u64, ptrs = ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)
    if not hasattr(lib, "mpzero_peers_device"):
        raise RuntimeError(f"{path} is a step library of an older mpzero (no mpzero_peers_device): rebuild it")
    lib.mpzero_peers_device.restype = ctypes.c_char_p
    built_for = lib.mpzero_peers_device().decode()
    if built_for != device:
        want = "libmpzero_peers_step_cuda.so" if device == "cuda" else "libmpzero_peers_step.so"
        raise RuntimeError(f"{path} steps {built_for} memory, and --device is {device}: give --lib {want}")
    text = ("configs", "last_error", "version") + \
        (("simd", "cxx_flags") if device == "cpu" else ("cuda_archs",))
    for name in text:
        getattr(lib, "mpzero_peers_" + name).restype = ctypes.c_char_p
        getattr(lib, "mpzero_peers_" + name).argtypes = []
    if device == "cpu":
        lib.mpzero_peers_march_native.restype = ctypes.c_int
        lib.mpzero_peers_max_threads.restype = ctypes.c_int
    else:
        lib.mpzero_peers_cuda_runtime.restype = ctypes.c_int
        lib.mpzero_peers_set_stream.argtypes = [vp]
        lib.mpzero_peers_set_stream.restype = None
    lib.mpzero_peers_run.argtypes = [vp, u64, ctypes.c_int]
    lib.mpzero_peers_run.restype = ctypes.c_int
    lib.mpzero_peers_destroy.argtypes = [vp]
    lib.mpzero_peers_destroy.restype = None
    have = lib.mpzero_peers_configs().decode().split(",")
    for config in CONFIGS:
        if config not in have:
            raise RuntimeError(f"{path} has no configuration {config} (it has {have}): rebuild it")
        create = getattr(lib, "mpzero_peers_create_" + config)
        create.argtypes = [u64, ptrs, ptrs, ptrs, ptrs, ptrs, ctypes.POINTER(u64), ctypes.POINTER(Hparams)]
        create.restype = vp
        step = getattr(lib, "mpzero_peers_step_" + config)
        step.argtypes = [vp, vp, vp, vp, vp, u64, ctypes.POINTER(Hparams), u64, ctypes.c_int]
        step.restype = ctypes.c_int
    return lib


# ---- the tensors of one row -------------------------------------------------------------------

torch = None  # imported by main() once OMP_NUM_THREADS is set
DEVICE = "cpu"  # where every contender's tensors live: main() sets it from --device


def dtype_of(name):
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


class Model:
    """One row's model state: a list of tensors per role, each tensor its own allocation,
    filled from a fixed seed with bench_common.hpp's value ranges. Every contender steps
    these very tensors."""

    def __init__(self, config, numels, seed):
        p, m, g, s, _ = CONFIGS[config]
        self.config, self.numels = config, numels
        gen = torch.Generator().manual_seed(seed)

        def filled(n, role, dtype):
            lo, hi = FILL[role]
            # Drawn on the CPU, so that a size gets the same values on either device.
            return torch.empty(n, dtype=torch.float32).uniform_(lo, hi, generator=gen).to(device=DEVICE, dtype=dtype)

        if m is None:
            self.params, self.masters = [filled(n, "param", dtype_of(p)) for n in numels], None
        else:
            self.masters = [filled(n, "param", dtype_of(m)) for n in numels]
            self.params = [w.to(dtype_of(p)) for w in self.masters]
        self.grads = [filled(n, "grad", dtype_of(g)) for n in numels]
        self.exp_avgs = [filled(n, "exp_avg", dtype_of(s)) for n in numels]
        self.exp_avg_sqs = [filled(n, "exp_avg_sq", dtype_of(s)) for n in numels]
        self._grads32 = None

    def grads32(self):
        """The fp32 gradient buffers of the fp32-master composites (allocated once, shared)."""
        if self._grads32 is None:
            self._grads32 = [torch.empty(n, dtype=torch.float32, device=DEVICE) for n in self.numels]
        return self._grads32

    def roles(self):
        """(role, dtype name, tensors) of everything a step writes."""
        p, m, _, s, _ = CONFIGS[self.config]
        out = [("param", p, self.params)]
        if m is not None:
            out.append(("master", m, self.masters))
        return out + [("exp_avg", s, self.exp_avgs), ("exp_avg_sq", s, self.exp_avg_sqs)]

    def snapshot(self):
        return {role: [t.clone() for t in ts] for role, _, ts in self.roles()}

    def restore(self, snap):
        for role, _, ts in self.roles():
            for t, saved in zip(ts, snap[role]):
                t.copy_(saved)


def max_error(role, dtype, got, ref):
    """The largest difference of `got` from `ref` over a role's tensors: relative (with a
    floor) for fp32, in ulps of the larger magnitude (with a floor) for 16-bit types.
    Returns (metric, value, limit)."""
    worst = 0.0
    block = 1 << 22
    for x, y in zip(got, ref):
        for i in range(0, x.numel(), block):
            a, b = x[i:i + block].double(), y[i:i + block].double()
            if dtype == "fp32":
                floor = TOL_FP32[role][1]
                err = ((a - b).abs() / b.abs().clamp_min(floor)).max().item()
            else:
                mag = torch.maximum(a.abs(), b.abs()).clamp_min(FLOOR_16[role])
                _, e = torch.frexp(mag)
                ulp = torch.ldexp(torch.ones_like(mag), e - 1 - MANTISSA_BITS[dtype])
                err = ((a - b).abs() / ulp).max().item()
            worst = max(worst, err)
    if dtype == "fp32":
        return "max rel diff", worst, TOL_FP32[role][0]
    return "max ulp diff", worst, 1.0


def compare(model, ref):
    items = []
    for role, dtype, ts in model.roles():
        metric, value, limit = max_error(role, dtype, ts, ref[role])
        items.append({"what": role, "dtype": dtype, "metric": metric, "value": value, "limit": limit,
                      "ok": value <= limit})
    return {"ok": all(i["ok"] for i in items), "items": items}


def check_text(check):
    return ", ".join(f"{i['what']} {i['value']:.3g}{' ulp' if 'ulp' in i['metric'] else ' rel'}"
                     f"{'' if i['ok'] else ' (limit %g) FAILED' % i['limit']}" for i in check["items"])


# ---- contenders ---------------------------------------------------------------------------

class Mpzero:
    """mpzero's host step over the row's tensors: a fused_step built once (its multi-tensor
    plan), run every step through mpzero_peers_run."""

    def __init__(self, lib, model, threads, config=None):
        """config: the policy to step the model's tensors with (default the model's own; the
        stochastic-rounding row also times bf16_all's nearest rounding over its tensors)."""
        self.lib, self.threads, self.config = lib, threads, config or model.config
        n = len(model.numels)

        def ptrs(ts):
            return None if ts is None else (ctypes.c_void_p * n)(*[t.data_ptr() for t in ts])

        self.hp = Hparams(HPARAMS["lr"], HPARAMS["beta1"], HPARAMS["beta2"], HPARAMS["eps"],
                          HPARAMS["weight_decay"], HPARAMS["seed"])
        self._arrays = [ptrs(model.params), ptrs(model.masters), ptrs(model.grads), ptrs(model.exp_avgs),
                        ptrs(model.exp_avg_sqs), (ctypes.c_uint64 * n)(*model.numels)]
        create = getattr(lib, "mpzero_peers_create_" + self.config)
        self.handle = create(n, *self._arrays, ctypes.byref(self.hp))
        if not self.handle:
            raise RuntimeError("mpzero_peers_create_%s: %s" % (self.config, lib.mpzero_peers_last_error().decode()))
        self.t = HPARAMS["first_step"]

    def set_step(self, k):
        self.t = k

    def step(self):
        if self.lib.mpzero_peers_run(self.handle, self.t, self.threads) != 0:
            raise RuntimeError("mpzero_peers_run: " + self.lib.mpzero_peers_last_error().decode())
        self.t += 1

    def step_one_shot(self, model):
        """The single-tensor entry point (plan built in the call) at the current step."""
        f = getattr(self.lib, "mpzero_peers_step_" + self.config)
        master = model.masters[0].data_ptr() if model.masters else None
        if f(model.params[0].data_ptr(), master, model.grads[0].data_ptr(), model.exp_avgs[0].data_ptr(),
             model.exp_avg_sqs[0].data_ptr(), model.numels[0], ctypes.byref(self.hp), self.t, self.threads) != 0:
            raise RuntimeError("mpzero_peers_step_%s: %s" % (self.config, self.lib.mpzero_peers_last_error().decode()))

    def close(self):
        if self.handle:
            self.lib.mpzero_peers_destroy(self.handle)
            self.handle = None


class OptimizerPeer:
    """A torch.optim optimizer over the row's tensors, its states the row's own (injected,
    so it starts from the same moments and step count as mpzero). Natively it steps the
    parameters; as the fp32-master composite it steps the fp32 masters, with the 16-bit
    gradients copied into fp32 buffers first and the masters copied into the 16-bit
    parameters after.

    plan["step"] says where the optimizer keeps its step count: "int" (DeepSpeed: a
    Python int per state), "tensor" (torch, torchao: a float32 scalar tensor per state, on
    the device for torch's fused kernels and on the CPU otherwise, as each creates it),
    "group" (TransformerEngine: the parameter group's count) or "own" (a reference peer
    whose states are its own: not injected). plan["master_state"] names the state that
    holds an optimizer's own fp32 master (TransformerEngine's "master_param"): the row's
    master is injected there. plan["init_state"](optimizer, tensor), where given, lets the
    optimizer set up a tensor's state first (TransformerEngine keeps a scale per state
    beside it), and the row's tensors then replace its own."""

    def __init__(self, plan, model):
        self.model = model
        self.step_kind = plan.get("step", "tensor")
        # A composite, or a reference of a configuration with masters, steps the fp32 masters.
        self.composite = plan["how"] == "composite" or (plan["how"] == "reference" and model.masters is not None)
        targets = model.masters if self.composite else model.params
        grads = model.grads32() if self.composite else model.grads
        for t, g in zip(targets, grads):
            t.grad = g
        self.opt = plan["make"](targets)
        self.states = []
        if self.step_kind != "own":
            step_device = DEVICE if plan.get("step_on_device") else "cpu"
            for i, (t, m, v) in enumerate(zip(targets, model.exp_avgs, model.exp_avg_sqs)):
                if plan.get("init_state"):  # the optimizer's own bookkeeping first, then the row's tensors
                    plan["init_state"](self.opt, t)
                st = self.opt.state[t]  # torch.optim's state is a defaultdict: a new tensor gets {}
                st.update(exp_avg=m, exp_avg_sq=v)
                if self.step_kind == "int":
                    st["step"] = 0
                elif self.step_kind == "tensor":
                    st["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                if plan.get("master_state"):
                    st[plan["master_state"]] = model.masters[i]
                self.states.append(st)
        self.set_step(HPARAMS["first_step"])

    def set_step(self, k):
        # The optimizer adds 1 before its update.
        if self.step_kind == "group":
            for g in self.opt.param_groups:
                g["step"] = k - 1
        for st in self.states:
            if self.step_kind == "int":
                st["step"] = k - 1
            elif self.step_kind == "tensor":
                st["step"].fill_(k - 1)

    def step(self):
        if self.composite:
            torch._foreach_copy_(self.model.grads32(), self.model.grads)
            self.opt.step()
            torch._foreach_copy_(self.model.params, self.model.masters)
        else:
            self.opt.step()

    def close(self):
        self.opt = None
        self.states = []


TORCH_FLAGS = {"torch fused": {"fused": True}, "torch foreach": {"foreach": True, "fused": False},
               "torch for-loop": {"foreach": False, "fused": False}}


def adamw_kwargs(**extra):
    """The hyperparameters in torch.optim's keywords."""
    return dict(lr=HPARAMS["lr"], betas=(HPARAMS["beta1"], HPARAMS["beta2"]), eps=HPARAMS["eps"],
                weight_decay=HPARAMS["weight_decay"], **extra)


def torch_maker(name):
    flags = TORCH_FLAGS[name]
    return lambda targets: torch.optim.AdamW(targets, **adamw_kwargs(amsgrad=False, **flags))


def deepspeed_maker(ds, state_dtype):
    def make(targets):
        if DEVICE == "cuda":  # FusedAdam: states in the parameter's dtype
            return ds["cls"](targets, **adamw_kwargs(bias_correction=True, adam_w_mode=True, amsgrad=False))
        kw = adamw_kwargs(bias_correction=True, amsgrad=False, adamw_mode=True)
        if ds["has_fp32_optimizer_states"]:
            kw["fp32_optimizer_states"] = state_dtype == "fp32"
        return ds["cls"](targets, **kw)
    return make


def torchao_maker(ao, sr):
    return lambda targets: ao["cls"](targets, **adamw_kwargs(amsgrad=False, bf16_stochastic_round=sr))


def te_maker(te, **dtypes):
    return lambda targets: te["cls"](targets, **adamw_kwargs(bias_correction=True, adam_w_mode=True, **dtypes))


def te_init_state(opt, t):
    """TransformerEngine's FusedAdam.initialize_state (with store_param_remainders off
    where it takes it): its states and their scales, which its step reads for states
    other than fp32."""
    import inspect
    init = opt.initialize_state
    if "store_param_remainders" in inspect.signature(init).parameters:
        init(t, store_param_remainders=False)
    else:
        init(t)


def bnb_maker(bnb):
    return lambda targets: bnb["cls"](targets, **adamw_kwargs())


def composite_note(who, p):
    """The note of a peer that steps one dtype, run as the fp32-master composite."""
    return (f"{who} steps one dtype for parameter, gradient and states: the {p} gradient copied into an fp32 "
            f"buffer, the step on the fp32 master, the master copied into the {p} parameter (torch._foreach_copy_)")


def substitute_note(label, p):
    return f"{label} has no stochastic rounding; compared against its nearest-rounding {p} step"


_probe_cache = {}


def probe(key, make, pdtype, sdtype):
    """None if the optimizer steps pdtype parameters with sdtype states (tiny tensors),
    else its error message."""
    if key not in _probe_cache:
        p = torch.zeros(64, dtype=dtype_of(pdtype), device=DEVICE)
        p.grad = torch.full((64,), 1e-3, dtype=dtype_of(pdtype), device=DEVICE)
        try:
            opt = make([p])
            # As each keeps it: DeepSpeed an int, torch's fused kernels a tensor on the device.
            step = 0 if key[0] == "deepspeed" else \
                torch.zeros((), dtype=torch.float32, device=DEVICE if key[0] == "torch fused" else "cpu")
            opt.state[p] = {"step": step,
                            "exp_avg": torch.zeros(64, dtype=dtype_of(sdtype), device=DEVICE),
                            "exp_avg_sq": torch.zeros(64, dtype=dtype_of(sdtype), device=DEVICE)}
            opt.step()
            _probe_cache[key] = None
        except Exception as e:  # noqa: BLE001 (any failure means: cannot run this)
            _probe_cache[key] = " ".join(str(e).split())[:300]
    return _probe_cache[key]


def plan_torchao(config, layout, ao):
    p, m, _, s, sr = CONFIGS[config]
    label = f"torchao {ao['version']}"
    if layout != "single":
        return {"status": "skipped",
                "reason": f"{label}'s AdamW compiles its step (torch.compile, dynamic=False) once per tensor shape; "
                          "the benchmark runs it on the single-tensor rows only"}
    if m is not None:
        return {"status": "run", "how": "composite", "make": torchao_maker(ao, False),
                "note": composite_note(f"{label}'s AdamW", p)}
    if p != s:
        return {"status": "unsupported",
                "reason": f"{label}'s AdamW (torchao.optim._AdamW) creates its states in the parameter's dtype "
                          f"(torch.zeros_like): no {p} parameters with {s} states"}
    if sr:
        return {"status": "run", "how": "native", "make": torchao_maker(ao, True),
                "note": f"{label}'s AdamW with bf16_stochastic_round=True rounds the bf16 parameters stochastically "
                        "(16 bits from torch.randint) and its bf16 states to nearest; mpzero rounds all three "
                        "stochastically"}
    return {"status": "run", "how": "native", "make": torchao_maker(ao, False), "note": None}


def plan_deepspeed_cpu(config, ds):
    p, m, _, s, sr = CONFIGS[config]
    label = f"DeepSpeedCPUAdam {ds['version']}"
    combos = ds["dtypes"]
    scalar = ds.get("simd") == "AVX256" and m is None and "bf16" in (p, s)
    slow = " (its AVX2 build has no bf16 vector path: the scalar loop)" if scalar else ""
    if m is not None:
        if combos is not None and ("fp32", "fp32") not in combos:
            return {"status": "unsupported", "reason": f"{label} has no fp32 step"}
        return {"status": "run", "how": "composite", "make": deepspeed_maker(ds, "fp32"),
                "note": f"{label} has no fp32-master path for {p} parameters (its op steps the parameter in "
                        f"place, with gradients of the parameter's dtype); run as ZeRO-Offload keeps a {p} "
                        f"model's fp32 master on the CPU: the {p} gradient copied into an fp32 buffer, "
                        f"DeepSpeedCPUAdam on the fp32 master, the master copied into the {p} parameter"}
    supported = (p, s) in combos if combos is not None else \
        probe(("deepspeed", p, s), deepspeed_maker(ds, s), p, s) is None
    if not supported:
        have = ", ".join("/".join(c) for c in combos) if combos else "unknown"
        return {"status": "unsupported",
                "reason": f"{label} takes parameter/state dtypes {have}: no {p} parameters with {s} states"}
    if sr:
        return {"status": "run", "how": "substitute", "make": deepspeed_maker(ds, s),
                "note": substitute_note(label, p) + slow}
    return {"status": "run", "how": "native", "make": deepspeed_maker(ds, s), "note": f"{label}{slow}" if slow else None}


def plan_deepspeed_cuda(config, ds):
    p, m, _, s, sr = CONFIGS[config]
    label = f"DeepSpeed {ds['version']} FusedAdam"
    if m is not None:
        return {"status": "run", "how": "composite", "make": deepspeed_maker(ds, "fp32"),
                "note": composite_note(label, p)}
    if p != s:
        # Not probed: its multi_tensor_adam kernel takes one element type for all four
        # lists and checks none, so a step would read the states past their end.
        return {"status": "unsupported",
                "reason": f"{label} steps parameter, gradient and states of one dtype (its multi_tensor_adam "
                          f"kernel takes one element type for all four): no {p} parameters with {s} states"}
    if sr:
        return {"status": "run", "how": "substitute", "make": deepspeed_maker(ds, s), "note": substitute_note(label, p)}
    return {"status": "run", "how": "native", "make": deepspeed_maker(ds, s), "note": None}


def plan_te(config, te):
    p, m, _, s, sr = CONFIGS[config]
    label = f"TransformerEngine {te['version']} FusedAdam"
    dtypes = {"exp_avg_dtype": dtype_of(s), "exp_avg_sq_dtype": dtype_of(s)}
    if m is not None:
        return {"status": "run", "how": "native", "step": "group", "master_state": "master_param",
                "init_state": te_init_state,
                "make": te_maker(te, master_weights=True, master_weight_dtype=torch.float32, **dtypes),
                "note": f"{label} with master_weights=True keeps the fp32 master itself (its 'master_param' state)"}
    return {"status": "run", "how": "substitute" if sr else "native", "step": "group", "init_state": te_init_state,
            "make": te_maker(te, **dtypes), "note": substitute_note(label, p) if sr else None}


def plan_bnb(config, bnb):
    p, m, _, s, _ = CONFIGS[config]
    return {"status": "run", "how": "reference", "step": "own", "make": bnb_maker(bnb),
            "note": f"bitsandbytes {bnb['version']} AdamW8bit keeps its two states as 8-bit blockwise-quantized codes "
                    f"(2 bytes per element, against {2 * BYTES[s]} here){' and steps the fp32 master' if m else ''}: "
                    "another update, so not compared; timed as the memory-saving reference"}


def plan_peer(pid, config, layout, infos):
    """How peer `pid` runs a configuration: a dict with status ("run", "unsupported",
    "unavailable", "skipped"), how ("native", "composite", "substitute", "reference"),
    note or reason, make, and the keys OptimizerPeer reads (step, step_on_device,
    master_state)."""
    p, m, _, s, sr = CONFIGS[config]
    info = infos.get(pid)
    if info is not None and not info["available"]:
        return {"status": "unavailable", "reason": info["reason"]}
    if pid == "torchao":
        return plan_torchao(config, layout, info)
    if pid == "deepspeed":
        return dict(plan_deepspeed_cuda(config, info) if DEVICE == "cuda" else plan_deepspeed_cpu(config, info),
                    step="int")
    if pid == "te":
        return plan_te(config, info)
    if pid == "bnb":
        return plan_bnb(config, bnb=info)

    name = peer_name(pid, DEVICE)
    make = torch_maker(name)
    label = f"torch {torch.__version__.split('+')[0]}"
    # torch's fused kernels take the step count on the parameters' device, its others on the CPU.
    common = {"make": make, "step": "tensor", "step_on_device": pid == "fused"}
    if m is not None:
        return dict(common, status="run", how="composite", note=composite_note(f"torch.optim.AdamW ({label})", p))
    if p != s:
        err = probe((name, p, s), make, p, s)
        if err is not None:
            return {"status": "unsupported",
                    "reason": f"torch.optim.AdamW ({label}) keeps its states in the parameter's dtype; {p} parameters "
                              f"with {s} states stop with: {err}"}
    if sr:
        return dict(common, status="run", how="substitute", note=substitute_note(label, p))
    return dict(common, status="run", how="native", note=None)


def _import_failed(info, who, e, pip):
    info["reason"] = f"{who}: not installed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); install it with: {pip}"
    print(f"{who} will not run: {info['reason']}", file=sys.stderr)
    return info


def deepspeed_info(wanted):
    info = {"available": False, "version": None, "reason": None, "dtypes": None, "simd": None}
    if not wanted:
        info["reason"] = "not requested (--peers)"
        return info
    if DEVICE == "cuda":
        return deepspeed_cuda_info(info)
    try:
        import logging
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    except Exception as e:  # noqa: BLE001 (ImportError, or a broken install)
        return _import_failed(info, "DeepSpeedCPUAdam", e, DEEPSPEED_PIP)
    info["version"] = deepspeed.__version__
    import inspect
    info["has_fp32_optimizer_states"] = "fp32_optimizer_states" in inspect.signature(DeepSpeedCPUAdam).parameters
    info["cls"] = DeepSpeedCPUAdam
    try:
        info["simd"] = {"-D__AVX512__": "AVX512", "-D__AVX256__": "AVX256"}.get(CPUAdamBuilder().simd_width(),
                                                                                CPUAdamBuilder().simd_width() or
                                                                                "scalar")
    except Exception:  # noqa: BLE001
        info["simd"] = None
    # The (parameter, state) dtypes its cpu_adam op dispatches on, from the installed source.
    src = os.path.join(os.path.dirname(deepspeed.__file__), "ops", "csrc", "adam", "cpu_adam_impl.cpp")
    names = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "at::BFloat16": "bf16",
             "at::Half": "fp16"}
    try:
        with open(src) as f:
            pairs = re.findall(r"create_invoker<\s*([\w:]+)\s*,\s*([\w:]+)\s*>\s*\(\s*\)\s*;", f.read())
        info["dtypes"] = [[names[a], names[b]] for a, b in pairs if a in names and b in names] or None
    except OSError:
        info["dtypes"] = None
    if info["dtypes"] is not None:
        info["dtypes"] = [tuple(d) for d in info["dtypes"]]
    print("loading DeepSpeed's cpu_adam op (built with ninja and g++ on first use: about a minute) ...", flush=True)
    try:
        p = torch.zeros(16)
        p.grad = torch.zeros(16)
        DeepSpeedCPUAdam([p]).step()
    except Exception as e:  # noqa: BLE001
        info["reason"] = f"DeepSpeedCPUAdam {deepspeed.__version__} could not build or load its cpu_adam op: " + \
            " ".join(str(e).split())[:300]
        print(info["reason"], file=sys.stderr)
        return info
    info["available"] = True
    return info


def deepspeed_cuda_info(info):
    try:
        import logging
        import deepspeed
        from deepspeed.ops.adam import FusedAdam
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    except Exception as e:  # noqa: BLE001
        return _import_failed(info, "DeepSpeed FusedAdam", e, DEEPSPEED_PIP)
    info.update(version=deepspeed.__version__, cls=FusedAdam)
    # Its fused_adam op is compiled on first use (ninja, nvcc) for the archs of
    # TORCH_CUDA_ARCH_LIST, else for every arch torch knows: name the GPU's own.
    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "%d.%d" % torch.cuda.get_device_capability()
    print(f"loading DeepSpeed's fused_adam op (built with ninja and nvcc on first use, for "
          f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}) ...", flush=True)
    t0 = time.perf_counter()
    try:
        p = torch.zeros(16, device="cuda")
        p.grad = torch.zeros(16, device="cuda")
        FusedAdam([p]).step()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        info["reason"] = f"DeepSpeed {deepspeed.__version__} FusedAdam could not build or load its fused_adam op: " + \
            " ".join(str(e).split())[:300]
        print(info["reason"], file=sys.stderr)
        return info
    info["op_load_s"] = time.perf_counter() - t0
    info["available"] = True
    return info


def simple_info(wanted, who, load, pip):
    """{available, version, reason, cls} of a peer whose class load() imports, returning
    (version, cls)."""
    info = {"available": False, "version": None, "reason": None}
    if not wanted:
        info["reason"] = "not requested (--peers)"
        return info
    try:
        version, cls = load()
    except Exception as e:  # noqa: BLE001 (ImportError, or a broken install)
        return _import_failed(info, who, e, pip)
    info.update(available=True, version=version, cls=cls)
    return info


def torchao_info(wanted):
    def load():
        import torchao
        from torchao.optim import _AdamW
        return torchao.__version__, _AdamW
    return simple_info(wanted, "torchao AdamW", load, TORCHAO_PIP)


def te_info(wanted):
    def load():
        import transformer_engine
        from transformer_engine.pytorch.optimizers import FusedAdam
        return transformer_engine.__version__, FusedAdam
    return simple_info(wanted, "TransformerEngine FusedAdam", load, TE_PIP)


def bnb_info(wanted):
    def load():
        import bitsandbytes
        return bitsandbytes.__version__, bitsandbytes.optim.AdamW8bit
    return simple_info(wanted, "bitsandbytes AdamW8bit", load, BNB_PIP)


# ---- one row: check, then time ------------------------------------------------------------

class Copy:
    """The copy baseline: torch's copy_ of half the bytes a step of the row reads and
    writes, so that it reads and writes the step's volume (the step's share of copy
    bandwidth is copy time / step time)."""

    def __init__(self, config, n):
        self.bytes = step_bytes(config) * n // 2
        self.src = torch.full((self.bytes,), 0x3C, dtype=torch.uint8, device=DEVICE)
        self.dst = torch.empty_like(self.src)

    def set_step(self, k):
        pass

    def step(self):
        self.dst.copy_(self.src)

    def close(self):
        self.src = self.dst = None


# Ahead of each timed CUDA step a spin kernel holds the stream while the step's work is
# enqueued, as nvbench's blocking kernel does: the events then time the GPU's work, and a
# launch's latency counts only where enqueueing takes longer than the spin (a peer that
# launches kernels per tensor from Python). 2M cycles: about 1 ms at 2 GHz.
SPIN_CYCLES = 2_000_000


def time_round(order):
    """One round: each (name, contender) of `order` steps once, timed; {name: seconds}."""
    out = {}
    if DEVICE != "cuda":
        for name, c in order:
            t0 = time.perf_counter()
            c.step()
            out[name] = time.perf_counter() - t0
        return out
    for name, c in order:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        c.step()
        stop.record()
        stop.synchronize()
        out[name] = start.elapsed_time(stop) / 1e3
    return out


def run_row(lib, threads, config, numels, layout, peer_ids, infos, warmup, rounds):
    n = sum(numels)
    title = f"{config}, {fmt_size(n)} elements, " + ("one tensor" if layout == "single" else f"{len(numels)} tensors")
    print(f" == {title}", flush=True)
    row = {"config": config, "numel": n, "layout": layout, "tensors": len(numels),
           "mpzero": {"status": "timed"}, "peers": {}}
    model = Model(config, numels, HPARAMS["seed"] + n + len(numels))
    mp = Mpzero(lib, model, threads)
    # Stochastic rounding's cost is measured against mpzero's own nearest rounding over the
    # same tensors, in the same rounds: rows differ in where their memory landed, which
    # moves every contender's time (up to 1.5x between two rows on a shared VM).
    nearest = Mpzero(lib, model, threads, config="bf16_all") if config == "bf16_all_sr" else None
    copy = Copy(config, n)
    first = HPARAMS["first_step"]
    contenders = []  # (name, peer, entry)
    try:
        for pid in peer_ids:
            name = peer_name(pid, DEVICE)
            plan = plan_peer(pid, config, layout, infos)
            entry = {"status": plan["status"], "how": plan.get("how"), "note": plan.get("note"),
                     "reason": plan.get("reason"), "check": None}
            row["peers"][name] = entry
            if plan["status"] != "run":
                continue
            try:
                peer = OptimizerPeer(plan, model)
            except Exception as e:  # noqa: BLE001
                entry.update(status="error", reason=f"{name} failed to start: {type(e).__name__}: "
                                                    f"{' '.join(str(e).split())[:300]}")
                continue
            contenders.append((name, peer, entry))

        # Correctness: one step of each from the same inputs, against mpzero's.
        pristine = model.snapshot()
        mp.set_step(first)
        mp.step()
        ref = model.snapshot()
        if all(torch.equal(a, b) for a, b in zip(ref["param"], pristine["param"])):
            raise RuntimeError(f"{title}: mpzero's step left the parameters unchanged")
        print(f"  check: one step (step {first}) from the same inputs, each against mpzero's result")
        if layout == "single":
            model.restore(pristine)
            mp.set_step(first)
            mp.step_one_shot(model)
            same = all(torch.equal(a, b) for role, _, ts in model.roles() for a, b in zip(ts, ref[role]))
            row["mpzero"]["one_shot_identical"] = same
            print(f"    {'mpzero one-shot':<22} {'native':<11} "
                  + ("identical to the planned step" if same else "DIFFERS from the planned step"))
            if not same:
                raise RuntimeError(f"{title}: mpzero_peers_step_{config} and the planned step disagree")
        for name, peer, entry in contenders:
            model.restore(pristine)
            peer.set_step(first)
            try:
                peer.step()
            except Exception as e:  # noqa: BLE001
                entry.update(status="error", reason=f"{name} failed: {type(e).__name__}: "
                                                    f"{' '.join(str(e).split())[:300]}")
                print(f"    {name:<22} {entry['how']:<11} {entry['reason']}")
                continue
            if entry["how"] == "reference":
                print(f"    {name:<22} {entry['how']:<11} stepped; another update, not compared")
                continue
            entry["check"] = compare(model, ref)
            if not entry["check"]["ok"]:
                entry["status"] = "differs"
                entry["reason"] = f"{name} differs from mpzero after one step from the same inputs: " + \
                    check_text(entry["check"])
            print(f"    {name:<22} {entry['how']:<11} {check_text(entry['check'])}: "
                  + ("ok" if entry["check"]["ok"] else "DIFFERS, not timed"))
        model.restore(pristine)
        del pristine, ref

        # Timing: warm-up, then rounds of every contender in a rotating order.
        timed = [("mpzero", mp)] + [(name, peer) for name, peer, entry in contenders if entry["status"] == "run"]
        if nearest is not None:
            timed.append(("mpzero nearest", nearest))
        timed.append(("copy", copy))
        for name, c in timed:
            c.set_step(first)
        for _ in range(warmup):
            for _, c in timed:
                c.step()
        times = {name: [] for name, _ in timed}
        gc.collect()
        gc.disable()
        try:
            for r in range(rounds):
                for name, t in time_round(rotated(timed, r)).items():
                    times[name].append(t)
        finally:
            gc.enable()
        row["mpzero"].update(median_s=statistics.median(times["mpzero"]), times_s=times["mpzero"])
        row["copy"] = dict(bytes=2 * copy.bytes, median_s=statistics.median(times["copy"]), times_s=times["copy"],
                           **ratio_summary(times["copy"], times["mpzero"]))
        timer = "CUDA events" if DEVICE == "cuda" else "perf_counter"
        print(f"  timing ({timer}): {warmup} warm-up step(s), {rounds} rounds in rotating order; ratio = peer / mpzero "
              "(median, min-max over rounds)")
        c = row["copy"]
        print(f"    {'mpzero':<22} {'native':<11} {row['mpzero']['median_s'] * 1e3:10.3f} ms   "
              f"{c['ratio_median']:.1%} of copy ({c['ratio_min']:.1%}-{c['ratio_max']:.1%}); copy of "
              f"{c['bytes'] / 1e6:.0f} MB read + written: {c['median_s'] * 1e3:.3f} ms, "
              f"{c['bytes'] / c['median_s'] / 1e9:.0f} GB/s")
        if nearest is not None:
            row["mpzero"]["nearest"] = dict(median_s=statistics.median(times["mpzero nearest"]),
                                            times_s=times["mpzero nearest"],
                                            **ratio_summary(times["mpzero"], times["mpzero nearest"]))
            e = row["mpzero"]["nearest"]
            print(f"    {'mpzero nearest':<22} {'bf16_all':<11} {e['median_s'] * 1e3:10.3f} ms   stochastic over "
                  f"nearest {e['ratio_median']:.2f} ({e['ratio_min']:.2f}-{e['ratio_max']:.2f})")
        for name, peer, entry in contenders:
            if entry["status"] != "run":
                continue
            entry.update(status="timed", median_s=statistics.median(times[name]), times_s=times[name],
                         **ratio_summary(times[name], times["mpzero"]))
            print(f"    {name:<22} {entry['how']:<11} {entry['median_s'] * 1e3:10.3f} ms   "
                  f"{entry['ratio_median']:.2f} ({entry['ratio_min']:.2f}-{entry['ratio_max']:.2f})")
        for name, entry in row["peers"].items():
            if entry["status"] != "timed":
                print(f"    {name:<22} {entry['status']:<11} {entry['reason']}")
    finally:
        mp.close()
        if nearest is not None:
            nearest.close()
        copy.close()
        for _, peer, _ in contenders:
            peer.close()
    return row

def nvidia_smi():
    """The GPU's name, driver, clocks, temperature and power as nvidia-smi reads them, or None."""
    fields = ("name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,temperature.gpu,power.draw,"
              "power.limit,clocks_throttle_reasons.active")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return dict(zip(fields.split(","), (v.strip() for v in out.stdout.splitlines()[0].split(","))))


def default_library(device):
    """The step library of `device` in the first build folder that has it (under the
    current directory, then under the repository), else the first candidate."""
    name = "libmpzero_peers_step_cuda.so" if device == "cuda" else "libmpzero_peers_step.so"
    folders = ("build-gpu", "build-bench", "build") if device == "cuda" else ("build-bench", "build")
    candidates = [os.path.join(base, f, "bench", name) for base in ("", REPO) for f in folders]
    return next((c for c in candidates if os.path.exists(c)), candidates[0])


def build_hint(device):
    if device == "cuda":
        return ("  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMPZERO_BUILD_TESTS=OFF "
                "-DMPZERO_BUILD_EXAMPLES=OFF -DMPZERO_BUILD_TORCH=OFF -DCMAKE_CUDA_ARCHITECTURES=90\n"
                "  cmake --build build-gpu --target mpzero_peers_step_cuda")
    return ("  cmake -S . -B build-bench -DCMAKE_BUILD_TYPE=Release -DMPZERO_BUILD_TESTS=OFF "
            "-DMPZERO_BUILD_EXAMPLES=OFF -DMPZERO_BUILD_TORCH=OFF\n"
            "  cmake --build build-bench --target mpzero_peers_step")


def main():
    global torch, DEVICE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=DEVICES,
                    help="where the tensors live and every contender steps them (default cpu)")
    ap.add_argument("--lib", default=None,
                    help="the step library: libmpzero_peers_step.so (cpu) or libmpzero_peers_step_cuda.so (cuda); "
                         "default: the first found under build-gpu (cuda), build-bench or build, in the current "
                         "directory, then in the repository")
    ap.add_argument("--sizes", help="elements per row (default 1M,16M,64M; with --device cuda 1M,16M,64M,256M)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated; default all")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="single, multi or both")
    ap.add_argument("--tensors", type=int, default=200, help="tensors of the multi layout (default 200)")
    ap.add_argument("--peers", default=None,
                    help="comma-separated; default every peer of the device: " + "; ".join(
                        f"{d}: {', '.join(peer_ids_for(d))}" for d in DEVICES))
    ap.add_argument("--rounds", type=int, help="timed rounds (default 15)")
    ap.add_argument("--warmup", type=int, help="untimed steps of each contender first (default 2)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OpenMP threads of every contender (default: OMP_NUM_THREADS, else all CPUs)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: by default 100000 elements (a ragged last chunk), 2 rounds, 1 warm-up")
    ap.add_argument("--huge-pages", action="store_true",
                    help="allocate the CPU tensors on transparent huge pages (torch's THP_MEM_ALLOC_ENABLE=1): "
                         "every contender streams them with fewer TLB misses; without it, 4 KiB pages unless "
                         "the kernel's THP mode is 'always'")
    ap.add_argument("--out", help="write the results as JSON (bench/peers_render.py reads it)")
    ap.add_argument("--stop-by", type=float, metavar="EPOCH_S",
                    help="start no row that would not end by this time (seconds since the epoch), judged by the "
                         "longest row so far: the rows left are listed and the run ends with its table")
    a = ap.parse_args()
    DEVICE = a.device
    if a.huge_pages:
        if DEVICE != "cpu":
            ap.error("--huge-pages places CPU tensors; with --device cuda the tensors are the GPU's")
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch's CPU allocator, imported below

    full_sizes = "1M,16M,64M,256M" if DEVICE == "cuda" else "1M,16M,64M"
    for key, full, quick in (("sizes", full_sizes, "100000"), ("rounds", 15, 2), ("warmup", 2, 1)):
        if getattr(a, key) is None:  # options given explicitly win over --quick's
            setattr(a, key, quick if a.quick else full)
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    except ValueError as e:
        ap.error(f"--sizes: {e}")
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    peer_ids = [p.strip() for p in (a.peers or ",".join(peer_ids_for(DEVICE))).split(",") if p.strip()]
    for what, got, known in (("configuration", configs, CONFIGS), ("layout", layouts, LAYOUTS),
                             ("peer", peer_ids, PEERS)):
        bad = [x for x in got if x not in known]
        if bad:
            ap.error(f"unknown {what} {', '.join(bad)}; known: {', '.join(known)}")
    elsewhere = [p for p in peer_ids if p not in peer_ids_for(DEVICE)]
    if elsewhere:
        ap.error(f"--peers {', '.join(elsewhere)}: not a peer on {DEVICE} (its peers: "
                 f"{', '.join(peer_ids_for(DEVICE))}); try --device cuda")
    if a.rounds < 1 or a.warmup < 0 or a.tensors < 1 or not sizes or min(sizes) < 1:
        ap.error("--rounds and --tensors must be at least 1, --warmup at least 0, sizes positive")

    # One thread count for everyone, fixed before torch starts its OpenMP runtime.
    env_threads = os.environ.get("OMP_NUM_THREADS")
    threads = a.threads or (int(env_threads) if env_threads and env_threads.isdigit() else None) or \
        len(os.sched_getaffinity(0))
    if env_threads and env_threads != str(threads):
        ap.error(f"OMP_NUM_THREADS={env_threads} disagrees with --threads {threads}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("DS_ACCELERATOR", DEVICE)  # DeepSpeed would otherwise probe for one and warn

    lib_path = a.lib or default_library(DEVICE)
    if not os.path.exists(lib_path):
        sys.exit(f"peers.py: no {lib_path}; build it with\n{build_hint(DEVICE)}\nor give --lib")

    load_before = loadavg()
    import torch as torch_module  # after OMP_NUM_THREADS: torch reads it when its runtime starts
    torch = torch_module
    torch.set_num_threads(threads)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit(f"peers.py: --device cuda, but torch {torch.__version__} sees no CUDA device "
                 f"(torch.version.cuda {torch.version.cuda}); run on a machine with an NVIDIA GPU and a CUDA build "
                 "of torch, or use --device cpu")
    # After torch: the library's libgomp.so.1 resolves to the runtime torch loaded.
    try:
        lib = load_library(lib_path, DEVICE)
    except (OSError, RuntimeError) as e:
        sys.exit(f"peers.py: {e}")
    if DEVICE == "cuda":
        torch.cuda.init()
        lib.mpzero_peers_set_stream(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    infos = {"deepspeed": deepspeed_info("deepspeed" in peer_ids), "torchao": torchao_info("torchao" in peer_ids)}
    if DEVICE == "cuda":
        infos.update(te=te_info("te" in peer_ids), bnb=bnb_info("bnb" in peer_ids))
    ds, ao = infos["deepspeed"], infos["torchao"]

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": DEVICE,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "deepspeed": ds["version"],
        "deepspeed_simd": ds.get("simd"),
        "deepspeed_dtypes": ds.get("dtypes"),
        "torchao": ao["version"],
        "mpzero_version": lib.mpzero_peers_version().decode(),
        "mpzero_commit": git_commit(),
        "mpzero_library": repo_relative(lib_path),
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "openmp_runtimes": openmp_runtimes(),
        "loadavg_before": load_before,
    }
    if DEVICE == "cpu":
        env.update(mpzero_host_simd=lib.mpzero_peers_simd().decode(),
                   mpzero_march_native=bool(lib.mpzero_peers_march_native()),
                   mpzero_cxx_flags=lib.mpzero_peers_cxx_flags().decode(),
                   mpzero_host_simd_cap=os.environ.get("MPZERO_HOST_SIMD"),
                   mpzero_threads=lib.mpzero_peers_max_threads(),
                   huge_pages=os.environ.get("THP_MEM_ALLOC_ENABLE") == "1", thp_mode=thp_mode())
    else:
        props = torch.cuda.get_device_properties(0)
        runtime = lib.mpzero_peers_cuda_runtime()
        env.update(gpu=props.name, gpu_capability="%d.%d" % (props.major, props.minor),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_sms=props.multi_processor_count,
                   torch_cuda=torch.version.cuda, mpzero_cuda_archs=lib.mpzero_peers_cuda_archs().decode(),
                   mpzero_cuda_runtime=f"{runtime // 1000}.{runtime % 1000 // 10}",
                   nvidia_smi_before=nvidia_smi(), te=infos["te"]["version"], bnb=infos["bnb"]["version"],
                   deepspeed_op_load_s=ds.get("op_load_s"), spin_cycles=SPIN_CYCLES)
    print("mpzero peers: AdamW, float32 values of lr {lr:.9g}, betas ({beta1:.9g}, {beta2:.9g}), eps {eps:.9g}, "
          "weight decay {weight_decay:.9g} (decoupled), bias correction, first step {first_step}".format(**HPARAMS))
    print(f"CPU {env['cpu_model']} ({env['logical_cpus']} logical CPUs); load average before "
          + (" ".join(f"{x:.2f}" for x in load_before) if load_before else "unknown"))
    if DEVICE == "cpu":
        print(f"threads {threads} (torch {env['torch_threads']}, mpzero {env['mpzero_threads']}, OMP_NUM_THREADS "
              f"{env['omp_num_threads']}); OpenMP runtimes loaded: {', '.join(env['openmp_runtimes']) or 'none found'}")
        print(f"tensors on {'transparent huge pages (THP_MEM_ALLOC_ENABLE=1)' if env['huge_pages'] else 'pages as torch allocates them'}"
              f"; kernel THP mode {env['thp_mode'] or 'unknown'}")
        print(f"mpzero {env['mpzero_version']} (commit {env['mpzero_commit'] or 'unknown'}), host step "
              f"{env['mpzero_host_simd']}, -march=native {'yes' if env['mpzero_march_native'] else 'no'}; "
              f"torch {env['torch']} (cpu capability {env['torch_cpu_capability']})")
    else:
        smi = env["nvidia_smi_before"] or {}
        print(f"GPU {env['gpu']} (sm_{env['gpu_capability'].replace('.', '')}, {env['gpu_sms']} SMs, "
              f"{env['gpu_memory_gib']} GiB); driver {smi.get('driver_version', '?')}, clocks SM "
              f"{smi.get('clocks.sm', '?')} (max {smi.get('clocks.max.sm', '?')}), memory {smi.get('clocks.mem', '?')}"
              f", {smi.get('temperature.gpu', '?')} C, {smi.get('power.draw', '?')}")
        print(f"mpzero {env['mpzero_version']} (commit {env['mpzero_commit'] or 'unknown'}), kernels for "
              f"{env['mpzero_cuda_archs'] or '?'}, CUDA runtime {env['mpzero_cuda_runtime']}; torch {env['torch']} "
              f"(CUDA {env['torch_cuda']}); timed with CUDA events behind a {SPIN_CYCLES}-cycle spin kernel")
    for pid, info in infos.items():
        if pid in peer_ids:
            print(f"{peer_name(pid, DEVICE)}: " + (info["version"] if info["available"] else
                                                   f"not available ({info['reason']})"))
    print(f"python {env['python']}")
    if DEVICE == "cpu" and (env["torch_threads"] != threads or env["mpzero_threads"] != threads):
        print(f"warning: thread counts disagree: torch {env['torch_threads']}, mpzero {env['mpzero_threads']}, "
              f"requested {threads}", file=sys.stderr)
    if DEVICE == "cpu" and load_before and load_before[0] > 0.5:
        print(f"warning: load average {load_before[0]:.2f}: other processes share the CPUs, and a step's OpenMP "
              "region waits for any of its threads that is not running; the timings measure that too",
              file=sys.stderr)
    if len(env["openmp_runtimes"]) > 1:
        print("warning: more than one OpenMP runtime is loaded; the contenders' thread pools differ",
              file=sys.stderr)

    peers = []
    for pid in peer_ids:
        info = infos.get(pid)
        if info is not None:
            peers.append({"name": peer_name(pid, DEVICE), "available": info["available"], "version": info["version"],
                          "reason": info["reason"]})
        else:
            peers.append({"name": peer_name(pid, DEVICE), "available": True, "version": torch.__version__,
                          "reason": None})
    results = []
    doc = {"format": FORMAT, "command": sys.argv, "environment": env, "hyperparameters": HPARAMS,
           "threads": threads, "rounds": a.rounds, "warmup": a.warmup, "tensors_multi": a.tensors,
           "peers": peers, "results": results, "complete": False}

    def finish_doc(complete):
        env["loadavg_after"] = loadavg()
        if DEVICE == "cuda":
            env["nvidia_smi_after"] = nvidia_smi()
        doc["complete"] = complete
        peers_render.validate(doc)
        if a.out:  # rewritten after every row: a run stopped early keeps the rows it measured
            import json
            with open(a.out + ".tmp", "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(a.out + ".tmp", a.out)

    rows = [(config, n, layout) for config in configs for n in sizes for layout in layouts]
    longest = 0.0
    for k, (config, n, layout) in enumerate(rows):
        if a.stop_by is not None and time.time() + longest > a.stop_by:
            doc["not_run"] = [{"config": c, "numel": m, "layout": x} for c, m, x in rows[k:]]
            print(f"\n--stop-by: {len(rows) - k} row(s) not started (a row takes up to {longest:.0f} s): "
                  + ", ".join(f"{c} {fmt_size(m)} {x}" for c, m, x in rows[k:]))
            finish_doc(complete=False)
            break
        numels = [n] if layout == "single" else mixed_sizes(n, a.tensors, HPARAMS["seed"] + n)
        print(f"\n[{k + 1}/{len(rows)}]", end="")
        t0 = time.time()
        results.append(run_row(lib, threads, config, numels, layout, peer_ids, infos, a.warmup, a.rounds))
        longest = max(longest, time.time() - t0)
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        finish_doc(complete=k + 1 == len(rows))

    print("load average after " + (" ".join(f"{x:.2f}" for x in env["loadavg_after"])
                                    if env["loadavg_after"] else "unknown"))
    print()
    print(peers_render.render(doc, markdown=False))
    if a.out:
        print(f"\nresults written to {a.out}; render them with: python3 bench/peers_render.py {a.out} --markdown")
    for pid, info in infos.items():
        if not info["available"] and pid in peer_ids:
            print(f"\n{info['reason']}")


if __name__ == "__main__":
    main()
