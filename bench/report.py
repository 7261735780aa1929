"""Markdown tables for bench/RESULTS.md from a run's JSON (peers, cluster, scaling, overlap).

    python bench/report.py --out bench/results > /tmp/tables.md
"""
import argparse
import glob
import json
import os

from ringcomm.units import human


def t(us):
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.0f} µs"


def peers(doc):
    out = []
    for n in sorted({r["world_size"] for r in doc["rows"]}):
        out.append(f"\n**all_reduce float32, N = {n}** (median of {doc['config']['rounds']}×{doc['config']['iters']} "
                   "calls of the slowest rank, libraries alternated round by round; vs = ringcomm time / peer time)\n")
        out.append("| size | library | time | busbw GB/s | #wrong | vs gloo | vs openmpi |")
        out.append("|---:|---|---:|---:|---:|---:|---:|")
        for r in (r for r in doc["rows"] if r["world_size"] == n and r["status"] == "ok"):
            name = r["library"] + (f"/{r['algorithm']}" if r["library"] == "ringcomm" else "")
            vs = [f"{r.get(k):.2f}" if r.get(k) is not None else "" for k in ("vs_gloo", "vs_openmpi")]
            out.append(f"| {human(r['size_bytes'])} | {name} | {t(r['time_us'])} | {r['busbw']:.3f} | {r['wrong']} | "
                       + " | ".join(vs) + " |")
    out.append("\n**targets** (ratio = ringcomm / peer; busbw ≥ bound, time ≤ bound)\n")
    out.append("| N | ringcomm | size | peer | metric | ratio | target | met |")
    out.append("|---:|---|---:|---|---|---:|---:|---|")
    for g in doc["targets"]:
        sign = "≥" if g["metric"] == "busbw" else "≤"
        out.append(f"| {g['world_size']} | {g['algorithm']} | {human(g['size_bytes'])} | {g['peer']} | {g['metric']} | "
                   f"{g['ratio']:.2f} | {sign} {g['bound']} | {'yes' if g['met'] else '**no**'} |")
    return "\n".join(out)


def scaling(directory):
    rows = {}
    for path in glob.glob(os.path.join(directory, "scaling_n*.json")):
        with open(path) as f:
            doc = json.load(f)
        for r in doc["rows"]:
            rows.setdefault(r["world_size"] if "world_size" in r else doc["world_size"], {})[
                (r["algorithm"], r["size_bytes"])] = r["time_us"]
    out = ["| N | ring 4 MiB | ps 4 MiB | ps/ring | ring 64 MiB | ps 64 MiB | ps/ring |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted(rows):
        c = rows[n]
        cells = []
        for size in (4 << 20, 64 << 20):
            ring, ps = c.get(("ring", size)), c.get(("ps", size))
            cells += [t(ring), t(ps), f"{ps / ring:.2f}"] if ring and ps else ["", "", ""]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def overlap(doc):
    return (f"DDP, {doc['world_size']} ranks, {doc['rate']} links, model {doc['model'][1]}: overlap "
            f"{doc['overlap_s'] * 1e3:.1f} ms/step (runs: {', '.join(f'{x * 1e3:.1f}' for x in doc['overlap'])}), "
            f"no overlap {doc['no_overlap_s'] * 1e3:.1f} ms/step (runs: "
            f"{', '.join(f'{x * 1e3:.1f}' for x in doc['no_overlap'])}): overlap saves {doc['saving'] * 100:.1f} %")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    with open(os.path.join(args.out, "peers.json")) as f:
        print(peers(json.load(f)))
    print("\n**all_reduce time vs N on loopback, ring vs PS**\n")
    print(scaling(args.out))
    for path in sorted(glob.glob(os.path.join(args.out, "cluster_training*.json"))):
        with open(path) as f:
            print("\n- " + overlap(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
