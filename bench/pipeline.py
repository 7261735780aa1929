"""Pipeline schedules: step time, idle ("bubble") fraction and peak activation memory for
GPipe vs 1F1B over the number of micro-batches M, against the formula (P−1)/(M+P−1).

    python bench/pipeline.py [--pp 4] [--micro-batches 1,2,4,8] [--steps 6] [--out bench/out]

Each point is a real job (``python -m ringcomm.launch --nproc P -m ringcomm.train --pp P
--micro-batches M --schedule S --metrics-json``). The measured idle fraction is the time a
stage spends blocked waiting for a neighbour over its step time, averaged over stages; with
P workers sharing fewer cores than P it also contains waiting for a core, so read it beside
the formula, not as equal to it. Writes ``pipeline.json`` and ``pipeline.png``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODEL = ["--layers", "256,512,512,512,512,512,512,512,10", "--batch-size", "256", "--samples", "2048"]


def run(pp, m, sched, steps):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.json")
        cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(pp), "-m", "ringcomm.train", "--pp", str(pp),
               "--micro-batches", str(m), "--schedule", sched, "--steps", str(steps), "--metrics-json", path, *MODEL]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-2000:])
        with open(path) as f:
            doc = json.load(f)
    rows = doc["per_rank"]
    return {"schedule": sched, "micro_batches": m, "step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "idle": statistics.mean(r["bubble_fraction"] for r in rows), "formula": rows[0]["bubble_formula"],
            "peak_activation_bytes": max(r["peak_activation_bytes"] or 0 for r in rows)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--micro-batches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for m in [int(x) for x in args.micro_batches.split(",")]:
        for sched in ("gpipe", "1f1b"):  # alternate, so noise hits both alike
            rows.append(run(args.pp, m, sched, args.steps))
    print(f"pipeline of {args.pp} stages, model {MODEL[1]}, global batch {MODEL[3]}")
    print(f"{'schedule':<8}{'M':>4}{'step ms':>10}{'idle':>7}{'(P-1)/(M+P-1)':>15}{'peak activations KiB':>22}")
    for r in rows:
        print(f"{r['schedule']:<8}{r['micro_batches']:>4}{r['step_time_s'] * 1e3:>10.1f}{r['idle']:>7.2f}"
              f"{r['formula']:>15.2f}{r['peak_activation_bytes'] / 1024:>22.1f}")
    with open(os.path.join(args.out, "pipeline.json"), "w") as f:
        json.dump({"pp": args.pp, "model": MODEL, "rows": rows}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for sched, marker in (("gpipe", "o"), ("1f1b", "s")):
        sel = [r for r in rows if r["schedule"] == sched]
        ms = [r["micro_batches"] for r in sel]
        a.plot(ms, [r["idle"] for r in sel], marker=marker, label=f"{sched} measured idle")
        b.plot(ms, [r["peak_activation_bytes"] / 1024 for r in sel], marker=marker, label=sched)
    sel = [r for r in rows if r["schedule"] == "gpipe"]
    a.plot([r["micro_batches"] for r in sel], [r["formula"] for r in sel], "k--", label="(P-1)/(M+P-1)")
    for axis, ylabel in ((a, "idle fraction"), (b, "peak activation memory per stage (KiB)")):
        axis.set_xlabel("micro-batches M")
        axis.set_ylabel(ylabel)
        axis.legend()
        axis.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "pipeline.png"), dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
