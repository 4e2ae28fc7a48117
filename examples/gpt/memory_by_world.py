#!/usr/bin/env python3
"""ZeRO's point, from the main job's runs at several world sizes (scripts/main_gpt.sh):
per configuration and world size, the bytes of model states a rank holds (measured by the
engine, rank 0) beside the memory model's prediction, and the peak with the reduction
buffers at their most (states + engine.memory().peak_buckets).

    memory_by_world.py RESULTS_JSON [RESULTS_JSON ...] --out DIR

Each RESULTS_JSON is a train_gpt results.json (its meta.world_size says the world size).
Prints a table; writes DIR/memory_by_world.csv and DIR/memory_by_world.png.
"""
import argparse
import csv
import json
import os
import sys


def load(paths):
    """{(config id, world size): run} over the files, and the sorted world sizes."""
    rows, worlds, order = {}, set(), []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        world = int(doc["meta"]["world_size"])
        worlds.add(world)
        for run in doc["runs"]:
            if run["id"] == "torch":
                continue  # no mpzero: no ZeRO states to show
            rows[(run["id"], world)] = run
            if run["id"] not in order:
                order.append(run["id"])
    return rows, sorted(worlds), order


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="train_gpt results.json files, one per world size")
    ap.add_argument("--out", required=True, help="where memory_by_world.csv and .png go")
    a = ap.parse_args()
    rows, worlds, order = load(a.results)
    if not rows:
        sys.exit("memory_by_world.py: no mpzero run in " + ", ".join(a.results))

    mib = 1 << 20
    header = ["config"] + [f"W={w}: held B/param (formula) | peak MiB" for w in worlds]
    print("\nmodel states per rank as the world grows (rank 0; held = measured between steps, "
          "peak = held + reduction buffers at their most)")
    print(f"{'config':<16}" + "".join(f"{'W=' + str(w):>30}" for w in worlds))
    table = []
    for cid in order:
        cells, line = [cid], f"{cid:<16}"
        for w in worlds:
            r = rows.get((cid, w))
            if r is None:
                cells.append("")
                line += f"{'-':>30}"
                continue
            held = r["measured_bytes_per_param"]
            pred = r["predicted_bytes_per_param"]
            peak = (r["measured_device_bytes"] + r["measured_host_bytes"] + r["bucket_bytes"]) / mib
            cells.append(f"{held:.2f} ({pred:.2f}) | {peak:.2f}")
            line += f"{held:>11.2f} ({pred:5.2f}) {peak:9.2f} MiB"
        print(line)
        table.append(cells)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "memory_by_world.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "world_size", "measured_bytes_per_param", "predicted_bytes_per_param",
                    "held_mib", "peak_mib", "bucket_mib"])
        for cid in order:
            for ws in worlds:
                r = rows.get((cid, ws))
                if r is None:
                    continue
                held = (r["measured_device_bytes"] + r["measured_host_bytes"]) / mib
                w.writerow([cid, ws, f"{r['measured_bytes_per_param']:.4f}", f"{r['predicted_bytes_per_param']:.4f}",
                            f"{held:.4f}", f"{held + r['bucket_bytes'] / mib:.4f}", f"{r['bucket_bytes'] / mib:.4f}"])

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(worlds)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(order) + 2), 5))
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:gray"]
    for k, ws in enumerate(worlds):
        xs, held, extra, pred = [], [], [], []
        for i, cid in enumerate(order):
            r = rows.get((cid, ws))
            if r is None:
                continue
            xs.append(i - 0.4 + width * (k + 0.5))
            held.append(r["measured_bytes_per_param"])
            extra.append(r["bucket_bytes"] / r["model_numel"])
            pred.append(r["predicted_bytes_per_param"])
        color = colors[k % len(colors)]
        ax.bar(xs, held, width, color=color, label=f"W={ws}: held (measured)")
        ax.bar(xs, extra, width, bottom=held, color=color, alpha=0.35, label=f"W={ws}: + buffers at peak")
        ax.scatter(xs, pred, marker="_", s=200, color="black", zorder=3,
                   label="memory model" if k == 0 else None)
    tops = [r["measured_bytes_per_param"] + r["bucket_bytes"] / r["model_numel"] for r in rows.values()]
    ax.set_ylim(0, 1.25 * max(tops))  # room for the legend above the tallest bar
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(order, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("bytes per parameter, per rank")
    ax.set_title("model states per rank at each world size (rank 0)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "memory_by_world.png"), dpi=120)
    plt.close(fig)
    print(f"wrote {os.path.join(a.out, 'memory_by_world.csv')} and {os.path.join(a.out, 'memory_by_world.png')}")


if __name__ == "__main__":
    main()
