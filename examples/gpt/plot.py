#!/usr/bin/env python3
"""Plots train_gpt's results: loss_curves.png (every configuration's training loss, its
held-out loss as a marker at the end, and a cross at each step that an fp16 overflow
skipped) and memory.png (measured bytes of model states
per configuration as bars, device and host stacked, with the memory model's prediction;
on a GPU, a second panel with each configuration's peak device memory).

    python3 examples/gpt/plot.py gpt_out/results.json [--out DIR]
"""
import argparse
import json
import math
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot.py needs matplotlib: pip install matplotlib")


def finite(x):
    """A loss as a float; NaN for what is not a finite number (train_gpt writes a diverged
    run's NaN and inf losses as JSON null)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else math.nan


def smooth(xs, k):
    """Trailing moving average over the finite values of the last k steps (the raw curves
    are noisy at batch 16); NaN where the window holds none, so that a diverged stretch
    shows as a gap instead of spreading to the end of the curve."""
    out = []
    for i in range(len(xs)):
        window = [x for x in xs[max(0, i - k + 1):i + 1] if not math.isnan(x)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def eval_label(r):
    e = finite(r.get("eval_loss"))
    return f"eval {e:.3f}" if not math.isnan(e) else "diverged: no finite eval loss"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="results.json written by train_gpt")
    ap.add_argument("--out", help="directory for the PNGs (default: the results file's)")
    ap.add_argument("--smooth", type=int, default=0, help="moving-average window in steps (default: steps/20)")
    a = ap.parse_args()
    with open(a.results) as f:
        data = json.load(f)
    runs, meta = data["runs"], data["meta"]
    if not runs:
        sys.exit(f"{a.results} holds no runs")
    out = a.out or os.path.dirname(os.path.abspath(a.results))
    os.makedirs(out, exist_ok=True)
    k = a.smooth or max(1, meta["steps"] // 20)
    title = (f"GPT {meta['layers']}x{meta['dim']}, seq {meta['seq']}, batch {meta['batch']}x{meta['world_size']}, "
             f"{meta['steps']} steps, fortunes corpus")

    # Loss curves: one colour per precision, one line style per stage/offload variant.
    precisions = list(dict.fromkeys(r["precision"] for r in runs))
    cmap = plt.get_cmap("tab10")
    styles = {(0, False): "-", (1, False): "--", (2, False): ":", (1, True): "-.", (2, True): (0, (5, 1, 1, 1, 1, 1)),
              (3, False): (0, (1, 1)), (3, True): (0, (3, 1, 1, 1))}
    # Top: the curves. Bottom: each curve minus the first configuration's (the base), where
    # precision effects show (they are small next to the loss itself).
    fig, (ax, dax) = plt.subplots(2, 1, figsize=(10, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base = smooth([finite(x) for x in runs[0]["train_loss"]], k)
    for r in runs:
        c = cmap(precisions.index(r["precision"]) % 10)
        ls = styles.get((r["stage"], r["offload"]), "-")
        ys = smooth([finite(x) for x in r["train_loss"]], k)
        steps = range(1, len(ys) + 1)
        ax.plot(steps, ys, color=c, linestyle=ls, linewidth=1.3, label=f"{r['id']} ({eval_label(r)})")
        ax.plot([len(ys)], [finite(r.get("eval_loss"))], marker="o", color=c, markersize=5)
        # Steps an fp16 overflow skipped (the parameters did not change), on the curve.
        skipped = [s for s in r.get("skipped_at", []) if 1 <= s <= len(ys) and not math.isnan(ys[s - 1])]
        if skipped:
            ax.plot(skipped, [ys[s - 1] for s in skipped], linestyle="none", marker="x", color=c, markersize=6)
        n = min(len(ys), len(base))
        dax.plot(range(1, n + 1), [ys[i] - base[i] for i in range(n)], color=c, linestyle=ls, linewidth=1.3)
    ax.set_ylabel(f"training loss, nats/byte\n({k}-step moving average)")
    any_skipped = any(r.get("skipped_at") for r in runs)
    ax.set_title(title + "\n(dots: held-out loss at the end" +
                 ("; crosses: steps skipped by an fp16 overflow)" if any_skipped else ")"), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    dax.axhline(0, color="black", linewidth=0.8)
    dax.set_xlabel("optimizer step")
    dax.set_ylabel(f"difference from {runs[0]['id']}")
    dax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_curves.png"), dpi=120)
    plt.close(fig)

    # Memory: measured model-state bytes (device + host), predicted bytes as a marker. On a
    # GPU a second panel shows the peak device memory (allocator peak + the core's device
    # bytes), which activations dominate: on one axis it would flatten the state bars.
    ids = [r["id"] for r in runs]
    x = range(len(runs))
    mib = 1 << 20
    peak = [r.get("peak_device_bytes", 0) / mib for r in runs]
    has_peak = any(p > 0 for p in peak)
    width = max(6, 0.8 * len(runs) + 2)
    if has_peak:
        fig, (ax, pax) = plt.subplots(1, 2, figsize=(2 * width, 5))
    else:
        fig, ax = plt.subplots(figsize=(width, 5))
    dev = [r["measured_device_bytes"] / mib for r in runs]
    host = [r["measured_host_bytes"] / mib for r in runs]
    pred = [r["predicted_bytes_per_param"] * r["model_numel"] / mib for r in runs]
    ax.bar(x, dev, color="tab:blue", label="measured, device (CPU-only: main memory)")
    ax.bar(x, host, bottom=dev, color="tab:orange", label="measured, host (CPU offload)")
    ax.scatter(x, pred, marker="_", s=600, color="black", zorder=3, label="memory model prediction")
    for i, r in enumerate(runs):
        ax.text(i, dev[i] + host[i], f"{r['measured_bytes_per_param']:.1f} B/p", ha="center", va="bottom", fontsize=7)
    top = max(d + h for d, h in zip(dev, host))
    ax.set_ylim(0, 1.3 * top)  # room for the labels and the legend
    ax.set_xticks(list(x))
    ax.set_xticklabels(ids, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"{title}\nmodel states, {runs[0]['model_numel']:,} parameters; labels: bytes per parameter",
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    if has_peak:
        pax.bar(x, peak, color="tab:red")
        for i, p in enumerate(peak):
            change = f"\n{100 * (p / peak[0] - 1):+.0f}%" if i > 0 and peak[0] > 0 else ""
            pax.text(i, p, f"{p:.0f}{change}", ha="center", va="bottom", fontsize=7)
        pax.set_ylim(0, 1.2 * max(peak))
        pax.set_xticks(list(x))
        pax.set_xticklabels(ids, rotation=45, ha="right", fontsize=8)
        pax.set_ylabel("MiB per rank")
        pax.set_title(f"peak device memory (allocator peak + mpzero's device bytes)\n"
                      f"labels: MiB, change against {runs[0]['id']}", fontsize=10)
        pax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=120)
    plt.close(fig)
    print(f"wrote {os.path.join(out, 'loss_curves.png')} and {os.path.join(out, 'memory.png')}")


if __name__ == "__main__":
    main()
