#!/usr/bin/env python3
"""Compares train_gpt's held-out losses across runs that differ only in --seed: the
stochastic-rounding criterion of docs/perf.md (final evaluation loss within 0.5% of the fp32
baseline) is smaller than one seed's noise, so it is judged on paired differences.

    python3 examples/gpt/compare_seeds.py run1/results.json run2/results.json ... \\
        [--base fp32/z0] [--tolerance 0.005] [--json summary.json]

For each configuration: its held-out loss per seed, the mean, and its change against the
base configuration of the same run (same seed, same batches), as the mean of those paired
changes with its standard error over the seeds. The verdict per configuration:
  "within"   the whole interval mean +- 2 standard errors lies inside +-tolerance,
  "outside"  the whole interval lies outside it,
  "undecided" otherwise (more seeds would tell),
  "diverged" when the configuration's loss is not finite (train_gpt writes null) on a seed
             whose base loss is: a seed must not drop out of the comparison unseen.
Runs of one seed count once: a second file with the same seed is refused, since it would
weigh that seed twice. Runs must differ in nothing but the seed: their recipes (results.json's
meta without the seed, the thread count, the corpus path, the configuration counts, --rounds
and the measured CPU product ratios) must be equal, and a run trained another way (other
steps, model, rate, --lr-schedule, device) is refused, naming what differs.

A summary written by --json can stand in for its runs: it holds each seed's losses and the
recipe, so a series grows over several runs without keeping every results.json, e.g.

    python3 examples/gpt/compare_seeds.py docs/data/seeds_big_constant.json new/seed*/results.json
"""
import argparse
import json
import math
import sys


def load(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        sys.exit(f"compare_seeds: cannot read {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        sys.exit(f"compare_seeds: {path} is not JSON ({e}); is it a train_gpt results.json?")
    if not isinstance(data, dict):
        sys.exit(f"compare_seeds: {path} is not a train_gpt results.json (nor a compare_seeds summary)")
    return data


# meta keys that do not change what a run computes (or, for cpu_matmul, only its choices do).
NOT_RECIPE = {"seed", "threads", "corpus", "configs_done", "configs_total", "rounds", "cpu_matmul"}


def recipe(meta):
    """What a run was trained with, but its seed: runs are compared only when these agree."""
    r = {k: v for k, v in meta.items() if k not in NOT_RECIPE}
    r.setdefault("lr_schedule", None)  # train_gpt before --lr-schedule: the constant rate
    if isinstance(r.get("device"), str):
        r["device"] = r["device"].split(":")[0]  # cuda:0 and cuda:1 compute alike
    cm = meta.get("cpu_matmul")
    if isinstance(cm, dict):
        r["cpu_matmul"] = {k: cm.get(k) for k in ("bf16", "fp16")}
    return r


def runs_of(path, data):
    """(path, seed, recipe, {config id: eval loss}) for each seed of a results.json or of a
    summary that --json wrote."""
    if "runs" in data and "meta" in data:
        meta = data["meta"]
        return [(path, meta.get("seed"), recipe(meta), {r["id"]: r.get("eval_loss") for r in data["runs"]})]
    if "seeds" in data and "configs" in data:
        if "recipe" not in data:
            sys.exit(f"compare_seeds: {path} is a summary without its runs' recipe (an older compare_seeds "
                     "wrote it); summarize its results.json files again")
        out = []
        for i, seed in enumerate(data["seeds"]):
            losses = {c["id"]: c["eval_loss"][i] for c in data["configs"]}
            out.append((f"{path} (seed {seed})", seed, data["recipe"], losses))
        return out
    sys.exit(f"compare_seeds: {path} has no 'runs' and 'meta': not a train_gpt results.json "
             "(nor a summary written by compare_seeds --json)")


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def mean_se(xs):
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def verdict(m, se, tol):
    if not math.isfinite(se):
        return "undecided"
    lo, hi = m - 2 * se, m + 2 * se
    if -tol <= lo and hi <= tol:
        return "within"
    if lo > tol or hi < -tol:
        return "outside"
    return "undecided"


def summarize(results, base, tol):
    seeds = []
    per_seed = []  # (seed, {config id: eval loss or None})
    first = None  # (where, recipe) of the first run
    for where, seed, rec, losses in (run for path, data in results for run in runs_of(path, data)):
        if seed in seeds:
            sys.exit(f"compare_seeds: {where} repeats seed {seed}; give each seed's results once")
        if first is None:
            first = (where, rec)
        elif rec != first[1]:
            diff = sorted(k for k in set(rec) | set(first[1]) if rec.get(k) != first[1].get(k))
            said = "; ".join(f"{k} {first[1].get(k)!r} there, {rec.get(k)!r} here" for k in diff)
            sys.exit(f"compare_seeds: {where} was trained otherwise than {first[0]}: {said}. "
                     "Compare runs that differ only in --seed")
        seeds.append(seed)
        per_seed.append((seed, losses))
    ids = []
    for _, losses in per_seed:
        ids += [i for i in losses if i not in ids]
    if base not in ids:
        sys.exit(f"compare_seeds: the base configuration '{base}' is in none of the runs "
                 f"(they hold {', '.join(ids)}); name one with --base")
    rows = []
    for cid in ids:
        losses = [l.get(cid) for _, l in per_seed]
        changes = [l[cid] / l[base] - 1 for _, l in per_seed
                   if cid in l and base in l and finite(l[cid]) and finite(l[base])]
        diverged = [seed for seed, l in per_seed if cid in l and finite(l.get(base)) and not finite(l[cid])]
        ok = [x for x in losses if finite(x)]
        row = {"id": cid, "eval_loss": losses, "mean_eval_loss": sum(ok) / len(ok) if ok else None,
               "seeds_used": len(changes), "diverged_seeds": diverged}
        if cid != base and (changes or diverged):
            m, se = mean_se(changes) if changes else (math.nan, math.nan)
            row.update(change_vs_base=None if math.isnan(m) else m, change_se=None if math.isnan(se) else se,
                       changes=changes, verdict="diverged" if diverged else verdict(m, se, tol))
        rows.append(row)
    return {"base": base, "tolerance": tol, "seeds": seeds, "recipe": first[1], "configs": rows}


def fmt_loss(x):
    return f"{x:.4f}" if finite(x) else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+",
                    help="train_gpt results.json files, one per seed, or summaries written by --json")
    ap.add_argument("--base", default="fp32/z0", help="the configuration compared against (default fp32/z0)")
    ap.add_argument("--tolerance", type=float, default=0.005, help="relative tolerance (default 0.005: 0.5%%)")
    ap.add_argument("--json", help="also write the summary here")
    a = ap.parse_args()
    if not (a.tolerance > 0):
        sys.exit(f"compare_seeds: --tolerance {a.tolerance}: must be positive (0.005 is 0.5%)")
    s = summarize([(p, load(p)) for p in a.results], a.base, a.tolerance)
    print(f"held-out loss by seed ({', '.join(str(x) for x in s['seeds'])}); change vs {s['base']}: "
          f"mean of the paired changes +- 2 standard errors, tolerance {100 * s['tolerance']:.2f}%")
    for r in s["configs"]:
        line = f"  {r['id']:<18} " + " ".join(f"{fmt_loss(x):>7}" for x in r["eval_loss"])
        line += f"   mean {fmt_loss(r['mean_eval_loss'])}"
        if "verdict" in r:
            if r["change_vs_base"] is not None:
                se = r["change_se"]
                band = f" +- {200 * se:.2f}%" if se is not None else " (one seed)"
                line += f"   {100 * r['change_vs_base']:+.2f}%{band}"
            line += f"  {r['verdict']}"
            if r["diverged_seeds"]:
                line += f" (seeds {', '.join(str(x) for x in r['diverged_seeds'])})"
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
