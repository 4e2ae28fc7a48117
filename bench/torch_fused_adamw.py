#!/usr/bin/env python3
"""torch's fused AdamW (torch.optim.AdamW(fused=True)) on a CUDA device, timed the way
mpzero_bench_cuda times mpzero's step (CUDA events around the step, median of many), over
the same sizes, so that the two tables of one run compare.

Configurations, each as a torch user trains it:
  fp32               fp32 parameters, gradients and states
  bf16_fp32_master   fp32 master parameters and states; the bf16 gradient is copied into
                     the master's fp32 gradient first and the master is copied back into
                     the bf16 model parameter after the step (three kernels in all)
  bf16_all           bf16 parameters, gradients and states (nearest rounding)

Prints one line per configuration and size (median milliseconds per step, elements per
second) and writes them as JSON with --out.

  python3 bench/torch_fused_adamw.py [--sizes 16777216,67108864,268435456] [--out FILE]
"""
import argparse
import json
import statistics

import torch


def time_steps(step, repeats, warmup=5):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def make(config, n, dev):
    g = torch.Generator(device=dev).manual_seed(n)
    if config == "fp32":
        p = torch.nn.Parameter(torch.randn(n, device=dev, generator=g))
        p.grad = torch.randn(n, device=dev, generator=g) * 1e-3
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
        return opt.step
    if config == "bf16_all":
        p = torch.nn.Parameter(torch.randn(n, device=dev, generator=g).to(torch.bfloat16))
        p.grad = (torch.randn(n, device=dev, generator=g) * 1e-3).to(torch.bfloat16)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
        return opt.step
    assert config == "bf16_fp32_master"
    master = torch.nn.Parameter(torch.randn(n, device=dev, generator=g))
    master.grad = torch.zeros(n, device=dev)
    model = master.detach().to(torch.bfloat16)
    grad16 = (torch.randn(n, device=dev, generator=g) * 1e-3).to(torch.bfloat16)
    opt = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.01, fused=True)

    def step():
        master.grad.copy_(grad16)
        opt.step()
        model.copy_(master.detach())

    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16777216,67108864,268435456")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(dev)}")
    for config in ("fp32", "bf16_fp32_master", "bf16_all"):
        for n in (int(s) for s in a.sizes.split(",")):
            ms = time_steps(make(config, n, dev), a.repeats)
            rows.append({"config": config, "numel": n, "ms": ms, "elements_per_s": n / (ms * 1e-3)})
            print(f"torch fused AdamW {config:18s} {n:>10d} elements  {ms:8.3f} ms  {n / ms / 1e6:7.2f} Gelem/s")
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"torch": torch.__version__, "cuda": torch.version.cuda,
                       "device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
