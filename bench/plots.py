"""PNG plots of the JSON that bench/collectives.py, bench/peers.py and bench/cluster.py wrote.

    python bench/plots.py [--out bench/out] [--fixed-size 4M]

Reads every ``*.json`` in ``--out`` and writes, next to them (matplotlib, Agg backend):

- ``collectives_busbw_n{N}.png`` (every sweep of >= 3 sizes): busbw vs size, one panel per
  collective, one line per algorithm (busbw = algbw x 2(N-1)/N all-reduce, (N-1)/N
  reduce-scatter / all-gather, 1 broadcast / reduce);
- ``ring_vs_ps_time_vs_n.png``: all-reduce time vs world size at ``--fixed-size``, ring vs
  PS, from every collectives file that measured that size (one file per N);
- ``peers.png``: all-reduce time and busbw vs size per library, one column per N;
- ``cluster_time_vs_n.png``: emulated-cluster all-reduce time vs N, one panel per number of
  ranks per host, measured (points) and predicted (lines; see bench/cluster.py).

A plot whose data is missing is skipped with a note; the script never invents points.
"""
import argparse
import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)

from ringcomm.units import human, parse_size  # noqa: E402

STYLE = {"ring": ("tab:blue", "o"), "ps": ("tab:red", "s"), "auto": ("tab:green", "^"), "hier": ("tab:brown", "P"),
         "rd": ("tab:purple", "v"), "ringcomm/ring": ("tab:blue", "o"),
         "ringcomm/auto": ("tab:green", "^"), "gloo": ("tab:orange", "s"), "openmpi": ("tab:gray", "D"),
         "floor": ("black", "x")}


def load(out):
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "*.json")), key=os.path.getmtime):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "benchmark" in data:
            found.setdefault(data["benchmark"], []).append((path, data))
    return found


def size_axis(ax, sizes):
    """Log2 size axis with ticks at powers of 4 within the measured sizes."""
    ax.set_xscale("log", base=2)
    ticks = [1 << k for k in range(0, 41, 2) if min(sizes) <= 1 << k <= max(sizes)] or sorted(set(sizes))
    ax.set_xticks(ticks)
    ax.set_xticklabels([human(t).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
    ax.grid(True, which="major", alpha=0.3)


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_collectives(path, data, out):
    n, rows = data["world_size"], data["rows"]
    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    cols = min(3, len(collectives))
    rows_ = -(-len(collectives) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4.5 * cols, 3.6 * rows_), squeeze=False)
    for ax in axes.flat[len(collectives):]:
        ax.set_visible(False)
    for ax, collective in zip(axes.flat, collectives, strict=False):
        mine = [r for r in rows if r["collective"] == collective]
        for algo in dict.fromkeys(r["algorithm"] for r in mine):
            pts = sorted((r["size_bytes"], r["busbw"]) for r in mine if r["algorithm"] == algo)
            color, marker = STYLE.get(algo, (None, "."))
            ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label=algo, ms=4)
        size_axis(ax, [r["size_bytes"] for r in mine])
        ax.set_title(f"{collective}, N={n}")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.legend(fontsize=8)
    stem = os.path.splitext(os.path.basename(path))[0]  # collectives_n4 -> collectives_busbw_n4
    name = stem.replace("collectives_", "collectives_busbw_") if stem.startswith("collectives_") else f"{stem}_busbw"
    save(fig, os.path.join(out, f"{name}.png"))


def plot_scaling(files, out, fixed):
    points = {}  # (algorithm, N) -> time_us; the newest file wins
    for _, data in files:
        for r in data["rows"]:
            if r["collective"] == "all_reduce" and r["algorithm"] in ("ring", "ps") and r["size_bytes"] == fixed:
                points[(r["algorithm"], data["world_size"])] = r["time_us"]
    if len({n for _, n in points}) < 2:
        print(f"skip ring_vs_ps_time_vs_n.png: all_reduce at {human(fixed)} measured for < 2 world sizes")
        return
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for algo in ("ring", "ps"):
        pts = sorted((n, t / 1e3) for (a, n), t in points.items() if a == algo)
        color, marker = STYLE[algo]
        ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label=algo)
    ax.set_xlabel("world size N (processes on this host)")
    ax.set_ylabel("all_reduce time (ms)")
    ax.set_title(f"all_reduce {human(fixed)} float32: ring vs PS (loopback)")
    ax.set_xticks(sorted({n for _, n in points}))
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, os.path.join(out, "ring_vs_ps_time_vs_n.png"))


def plot_peers(data, out):
    rows = [r for r in data["rows"] if "time_us" in r]
    sizes = sorted({r["world_size"] for r in data["rows"]})
    fig, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 6.5), squeeze=False)
    for col, n in enumerate(sizes):
        mine = [r for r in rows if r["world_size"] == n]
        for name in dict.fromkeys(label(r) for r in mine):
            pts = sorted((r["size_bytes"], r["time_us"] / 1e3, r["busbw"]) for r in mine if label(r) == name)
            color, marker = STYLE.get(name, (None, "."))
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=name)
            axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], marker=marker, color=color, label=name)
        missing = [f"{lib}: {s['status']}" for lib, s in data["libraries"].get(str(n), {}).items()
                   if s["status"] != "ok"]
        axes[0][col].set_title(f"all_reduce float32, N={n}" + (f"\n({'; '.join(missing)})" if missing else ""))
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("time (ms, log)")
        axes[1][col].set_yscale("log")
        axes[1][col].set_ylabel("busbw (GB/s, log)")
        for ax in axes[:, col]:
            size_axis(ax, [r["size_bytes"] for r in mine] or [1])
            ax.set_xlabel("size (bytes)")
            ax.legend(fontsize=8)
    save(fig, os.path.join(out, "peers.png"))


def label(row):
    return f"ringcomm/{row['algorithm']}" if row["library"] == "ringcomm" else row["library"]


def plot_cluster(data, out):
    """One panel per ranks-per-host L: time vs N for each algorithm, measured and predicted
    (rows measured with encryption, the default across hosts, where both were)."""
    rows = [r for r in data["rows"] if r.get("encrypted", True)] or data["rows"]
    per_host = sorted({r.get("ranks_per_host", 1) for r in rows})
    fig, axes = plt.subplots(1, len(per_host), figsize=(5.5 * len(per_host), 3.8), squeeze=False)
    for ax, L in zip(axes[0], per_host, strict=True):
        for algo in ("ring", "hier", "ps"):
            pts = sorted((r["world_size"], r["time_us"] / 1e3, r["predicted_us"] / 1e3) for r in rows
                         if r["algorithm"] == algo and r.get("ranks_per_host", 1) == L)
            if not pts:
                continue
            color, marker = STYLE[algo]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, color=color, label=f"{algo} measured")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "-", color=color, alpha=0.6,
                    label=f"{algo} predicted")
        ax.set_xlabel(f"world size N ({L} rank(s) per host, a link per rank)")
        ax.set_ylabel("all_reduce time (ms)")
        ax.set_yscale("log")
        ax.set_title(f"all_reduce {human(rows[0]['size_bytes'])}, {data['rate']} per rank link (tc)")
        ax.set_xticks(sorted({r["world_size"] for r in rows if r.get("ranks_per_host", 1) == L}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, os.path.join(out, "cluster_time_vs_n.png"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--fixed-size", type=parse_size, default=4 << 20,
                   help="all_reduce size of the time-vs-N plot (default 4M)")
    args = p.parse_args(argv)
    found = load(args.out)
    if not found:
        print(f"no benchmark JSON in {args.out}: run bench/collectives.py or bench/peers.py first")
        return 1
    for path, data in found.get("collectives", []):
        if len({r["size_bytes"] for r in data["rows"]}) >= 3:  # a sweep, not a scaling run
            plot_collectives(path, data, args.out)
    if "collectives" in found:
        plot_scaling(found["collectives"], args.out, args.fixed_size)
    for name, plot in (("peers", plot_peers), ("cluster", plot_cluster)):
        if name in found:
            plot(found[name][-1][1], args.out)
        else:
            print(f"skip {name}: no {name}.json in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
