#!/usr/bin/env python3
"""Renders bench/peers.py's results (JSON, format mpzero-peers/1) as a table of each peer's
time relative to mpzero's: one row per configuration x size x layout, one column per
peer, each cell the median over the rounds of peer time / mpzero time (above 1: mpzero
is faster) with the min-max over the rounds, or why that peer did not run. A peer that
ran the configuration another way than natively (an fp32-master composite, or its
nearest rounding in place of stochastic rounding, or a reference that computes another
update) carries a note number; the notes and reasons (each naming its peer) follow the
table. Two columns lead: mpzero's step time and its share of copy bandwidth (the time of
torch's copy_ of the step's volume over the step's time), and one closes each row: the
fastest peer that computes the same update (native or composite) as a ratio.

  python3 bench/peers_render.py results.json               aligned text
  python3 bench/peers_render.py results.json --markdown    markdown (docs)
  python3 bench/peers_render.py results.json --plot ratios.png   also a plot (matplotlib)

The format (checked by validate(), which bench/peers.py also runs before writing):
  format        "mpzero-peers/1"
  environment   dict: device ("cpu" when absent, or "cuda"), cpu_model, threads, torch,
                deepspeed and torchao (null when absent), mpzero_commit, mpzero_host_simd
                (cpu), gpu, nvidia_smi_before (cuda), loadavg_before, loadavg_after, ...
  hyperparameters, rounds, warmup, threads
  complete      (optional) false while the run is under way or when it stopped early:
                peers.py rewrites the file after every row
  not_run       (optional) [{config, numel, layout}]: rows a time limit kept from starting
  peers         [{name, available, version, reason}]
  results       [{config, numel, layout ("single"|"multi"), tensors,
                  copy (optional): {bytes (read + written), median_s, times_s, ratios,
                        ratio_median, ratio_min, ratio_max}: torch's copy_ of the step's
                        volume in the same rounds; the ratios are copy / mpzero,
                  mpzero: {status "timed", median_s, times_s, nearest (bf16_all_sr rows:
                           {median_s, times_s, ratios, ratio_median, ratio_min, ratio_max},
                           mpzero's nearest rounding over the same tensors in the same rounds;
                           the ratios are stochastic / nearest)},
                  peers: {name: {status, how, note, reason, check,
                                 median_s, times_s, ratios, ratio_median, ratio_min, ratio_max}}}]
  A peer's status is "timed" (then the timing keys are present), "differs" (failed the
  start-up check against mpzero), "unsupported", "unavailable", "skipped" (the benchmark
  chose not to run it there) or "error" (then reason says why); how is "native",
  "composite", "substitute" or "reference" (another update: not checked against mpzero's)
  for a peer that ran.
"""
import argparse
import json
import sys

FORMAT = "mpzero-peers/1"
STATUSES = ("timed", "differs", "unsupported", "unavailable", "skipped", "error")
HOWS = ("native", "composite", "substitute", "reference")
SAME_UPDATE = ("native", "composite")  # the hows that compute mpzero's update


class FormatError(ValueError):
    pass


def _need(d, key, types, where):
    if not isinstance(d, dict) or key not in d:
        raise FormatError(f"{where}: missing '{key}'")
    types = types if isinstance(types, tuple) else (types,)
    v = d[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):  # JSON true is no number
        raise FormatError(f"{where}.{key}: expected {' or '.join(t.__name__ for t in types)}, "
                          f"got {type(v).__name__}")
    return v


def _positive_number(d, key, where):
    v = _need(d, key, (int, float), where)
    if not v > 0:
        raise FormatError(f"{where}.{key}: must be positive, got {v}")
    return v


def _ratios(d, where):
    lo, med, hi = (_positive_number(d, k, where) for k in ("ratio_min", "ratio_median", "ratio_max"))
    if not lo <= med <= hi:
        raise FormatError(f"{where}: ratio_min <= ratio_median <= ratio_max does not hold ({lo}, {med}, {hi})")


def validate(doc):
    """Raises FormatError naming the first thing that does not fit the format."""
    if not isinstance(doc, dict):
        raise FormatError("the document is not a JSON object")
    if doc.get("format") != FORMAT:
        raise FormatError(f"format is {doc.get('format')!r}, expected {FORMAT!r}")
    _need(doc, "environment", dict, "document")
    _need(doc, "rounds", int, "document")
    if "complete" in doc:
        _need(doc, "complete", bool, "document")
    for i, r in enumerate(doc.get("not_run") or []):
        for key, types in (("config", str), ("numel", int), ("layout", str)):
            _need(r, key, types, f"not_run[{i}]")
    peers = _need(doc, "peers", list, "document")
    names = []
    for i, p in enumerate(peers):
        names.append(_need(p, "name", str, f"peers[{i}]"))
        _need(p, "available", bool, f"peers[{i}]")
    results = _need(doc, "results", list, "document")
    for i, r in enumerate(results):
        where = f"results[{i}]"
        _need(r, "config", str, where)
        _positive_number(r, "numel", where)
        if _need(r, "layout", str, where) not in ("single", "multi"):
            raise FormatError(f"{where}.layout: {r['layout']!r} is neither 'single' nor 'multi'")
        _positive_number(r, "tensors", where)
        m = _need(r, "mpzero", dict, where)
        _positive_number(m, "median_s", where + ".mpzero")
        if m.get("nearest") is not None:
            _ratios(m["nearest"], where + ".mpzero.nearest")
        if r.get("copy") is not None:
            _positive_number(r["copy"], "bytes", where + ".copy")
            _positive_number(r["copy"], "median_s", where + ".copy")
            _ratios(r["copy"], where + ".copy")
        for name, e in _need(r, "peers", dict, where).items():
            w = f"{where}.peers[{name!r}]"
            if name not in names:
                raise FormatError(f"{w}: not listed in 'peers'")
            status = _need(e, "status", str, w)
            if status not in STATUSES:
                raise FormatError(f"{w}.status: {status!r} is not one of {', '.join(STATUSES)}")
            if status == "timed":
                if e.get("how") not in HOWS:
                    raise FormatError(f"{w}.how: {e.get('how')!r} is not one of {', '.join(HOWS)}")
                _positive_number(e, "median_s", w)
                _ratios(e, w)
            elif not isinstance(e.get("reason"), str) or not e["reason"]:
                raise FormatError(f"{w}: status {status!r} needs a reason")
    return doc


def load(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror}") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} is not JSON: {e}") from e
    return validate(doc)


def fmt_size(n):
    for unit, b in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= b and n % b == 0:
            return f"{n // b}{unit}"
    return str(n)


def peer_names(doc):
    """Peers in the order of 'peers', then any only named in results."""
    names = [p["name"] for p in doc["peers"]]
    for r in doc["results"]:
        names += [n for n in r["peers"] if n not in names]
    return names


def table(doc, dash):
    """(header, rows, notes): the cells as strings, and the numbered notes."""
    names = peer_names(doc)
    notes = []

    def ref(text):
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    copies = any(r.get("copy") for r in doc["results"])  # results of older runs have no copy baseline
    header = ["config", "elements", "layout", "mpzero ms"] + (["% of copy"] if copies else []) + names + \
        ["fastest same update"]
    rows = []
    for r in doc["results"]:
        layout = "1 tensor" if r["layout"] == "single" else f"{r['tensors']} tensors"
        cells = [r["config"], fmt_size(r["numel"]), layout, f"{r['mpzero']['median_s'] * 1e3:.3f}"]
        if copies:
            c = r.get("copy")
            cells.append(f"{c['ratio_median']:.1%} ({c['ratio_min']:.1%}{dash}{c['ratio_max']:.1%})" if c else "")
        for name in names:
            e = r["peers"].get(name)
            if e is None:
                cells.append("")
            elif e["status"] == "timed":
                c = f"{e['ratio_median']:.2f} ({e['ratio_min']:.2f}{dash}{e['ratio_max']:.2f})"
                if e.get("note"):
                    c += " " + ref(e["note"])
                cells.append(c)
            else:
                cells.append(f"{e['status']} " + ref(e["reason"]))
        best = fastest_same_update(r)
        cells.append(f"{best[1]:.2f} {best[0]}" if best else "none timed")
        rows.append(cells)
    return header, rows, notes


def fastest_same_update(row):
    """(name, ratio_median) of the timed peer with the lowest median ratio among those that
    compute mpzero's update (native or composite), or None."""
    same = [(n, e["ratio_median"]) for n, e in row["peers"].items()
            if e["status"] == "timed" and e.get("how") in SAME_UPDATE]
    return min(same, key=lambda x: x[1]) if same else None


def summary(doc):
    env = doc["environment"]
    load = lambda k: " ".join(f"{x:.2f}" for x in env[k]) if env.get(k) else "?"  # noqa: E731
    versions = (f"torch {env.get('torch', '?')}, deepspeed {env.get('deepspeed') or 'not run'}, torchao "
                f"{env.get('torchao') or 'not run'}")
    cells = "Cells: peer time / mpzero time, median (min-max) over the rounds; above 1, mpzero is faster."
    if env.get("device") == "cuda":
        smi = env.get("nvidia_smi_before") or {}
        return (f"{env.get('gpu', '?')} (driver {smi.get('driver_version', '?')}, SM clock "
                f"{smi.get('clocks.sm', '?')} of {smi.get('clocks.max.sm', '?')} before); mpzero "
                f"{env.get('mpzero_commit') or env.get('mpzero_version') or '?'} (kernels for "
                f"{env.get('mpzero_cuda_archs') or '?'}), {versions}, TransformerEngine {env.get('te') or 'not run'}, "
                f"bitsandbytes {env.get('bnb') or 'not run'}, python {env.get('python', '?')}; {doc['rounds']} rounds, "
                f"CUDA events; CPU load average {load('loadavg_before')} before, {load('loadavg_after')} after. "
                + cells)
    return (f"{env.get('cpu_model', '?')}, {doc.get('threads', env.get('threads', '?'))} threads; "
            f"mpzero {env.get('mpzero_commit') or env.get('mpzero_version') or '?'} (host step "
            f"{env.get('mpzero_host_simd', '?')}), {versions}, "
            f"python {env.get('python', '?')}; {doc['rounds']} rounds; "
            f"tensors on {'huge pages' if env.get('huge_pages') else '4 KiB pages' if env.get('thp_mode') != 'always' else 'THP (always)'}; "
            f"load average {load('loadavg_before')} before, {load('loadavg_after')} after. " + cells)


def sr_over_nearest(doc):
    """mpzero's stochastic-rounding time over its nearest-rounding time on the same tensors
    in the same rounds, per bf16_all_sr row that timed both: [(size, layout, median, min,
    max)]."""
    out = []
    for r in doc["results"]:
        e = r["mpzero"].get("nearest")
        if r["config"] == "bf16_all_sr" and e:
            layout = "1 tensor" if r["layout"] == "single" else f"{r['tensors']} tensors"
            out.append((fmt_size(r["numel"]), layout, e["ratio_median"], e["ratio_min"], e["ratio_max"]))
    return out


def sr_line(doc, dash="-"):
    ratios = sr_over_nearest(doc)
    if not ratios:
        return None
    return ("mpzero's stochastic rounding over its nearest rounding, the same tensors in the same rounds "
            "(bf16_all_sr / bf16_all, median (min-max) over the rounds): "
            + ", ".join(f"{size} {layout} {med:.2f} ({lo:.2f}{dash}{hi:.2f})" for size, layout, med, lo, hi in ratios))


def render(doc, markdown=False):
    header, rows, notes = table(doc, "–" if markdown else "-")
    out = []
    if doc.get("complete") is False:
        left = doc.get("not_run") or []
        out.append(f"Partial results: the run stopped after {len(doc['results'])} row(s)."
                   + (" Not started: " + ", ".join(f"{r['config']} {fmt_size(r['numel'])} {r['layout']}" for r in left)
                      + "." if left else ""))
    if markdown:
        out.append(summary(doc))
        out.append("")
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" if i < 3 else "---:" for i in range(len(header))) + "|")
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        if notes:
            out.append("")
            out += [f"[{i + 1}] {n.replace('|', chr(92) + '|')}" + ("  " if i + 1 < len(notes) else "")
                    for i, n in enumerate(notes)]
    else:
        out.append(summary(doc))
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w)  # noqa: E731
                                       for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
        out.append(line(header))
        out += [line(r) for r in rows]
        out += [f"[{i + 1}] {n}" for i, n in enumerate(notes)]
    if sr_line(doc):
        out += ["", sr_line(doc, "–" if markdown else "-")]
    return "\n".join(out)


def plot(doc, path):
    """Each peer's median ratio per row, with its min-max as error bars, on a log axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = peer_names(doc)
    labels = [f"{r['config']} {fmt_size(r['numel'])} "
              f"{'x1' if r['layout'] == 'single' else 'x' + str(r['tensors'])}" for r in doc["results"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(labels) + 2), 5.5))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for i, r in enumerate(doc["results"]):
            e = r["peers"].get(name)
            if e and e["status"] == "timed":
                xs.append(i + (k - (len(names) - 1) / 2) * width)
                ys.append(e["ratio_median"])
                lo.append(e["ratio_median"] - e["ratio_min"])
                hi.append(e["ratio_max"] - e["ratio_median"])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=name)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7, rotation=60, ha="right", rotation_mode="anchor")
    ax.set_ylabel("peer time / mpzero time (>1: mpzero faster)")
    env = doc["environment"]
    where = (env.get("gpu", "?") if env.get("device") == "cuda" else
             f"CPU: {env.get('cpu_model', '?')}, {doc.get('threads', '?')} threads")
    ax.set_title(f"AdamW step on {where}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="JSON written by bench/peers.py --out")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--plot", metavar="PNG", help="also draw the ratios into this image (needs matplotlib)")
    a = ap.parse_args()
    try:
        doc = load(a.results)
    except FormatError as e:
        sys.exit(f"peers_render.py: {e}")
    print(render(doc, markdown=a.markdown))
    if a.plot:
        try:
            plot(doc, a.plot)
        except ImportError as e:
            sys.exit(f"peers_render.py: --plot needs matplotlib ({e}): python3 -m pip install matplotlib")


if __name__ == "__main__":
    main()
