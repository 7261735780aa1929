"""The GPT on every layout of 4 ranks: step time, activation memory per rank and bytes per
dimension against the formulas; then context parallelism on 1, 2 and 4 ranks of one
replica, where activation memory falls as 1/C and ring attention's hops hide behind compute.

    python bench/gpt_layouts.py [--steps 6] [--out bench/out]

Each row is a real job (``python -m ringcomm.launch --nproc N -m ringcomm.train --model gpt
... --metrics-json``). Step time: median step of the slowest rank. Activations: the most a
rank holds for backward (counted from its arrays / the formula of
``ringcomm.train.accounting.activations``) and its traced step peak (everything the step allocated,
transients included). Bytes: the most any rank sends per step in each dimension, measured /
formula. Ring attention: the time the cp ranks spend computing attention blocks against the
time they are blocked on a hop (exposed communication). Writes ``gpt_layouts.json`` and
``gpt_layouts.png``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODEL = ["--model", "gpt", "--n-layer", "4", "--n-head", "4", "--d-model", "64", "--seq-len", "128",
         "--optimizer", "sgd", "--lr", "0.1"]
LAYOUTS = [("dp4", []), ("dp4 zero3", ["--strategy", "zero3"]), ("cp4", ["--cp", "4"]), ("tp4", ["--tp", "4"]),
           ("tp4 sp", ["--tp", "4", "--sp"]), ("pp4 1f1b M4", ["--pp", "4", "--micro-batches", "4"]),
           ("dp2 cp2", ["--dp", "2", "--cp", "2"]), ("cp2 tp2", ["--cp", "2", "--tp", "2"]),
           ("dp2 tp2 sp", ["--dp", "2", "--tp", "2", "--sp"]), ("pp2 cp2", ["--pp", "2", "--cp", "2"]),
           ("pp2 tp2", ["--pp", "2", "--tp", "2"]), ("dp2 tp2 zero2", ["--dp", "2", "--tp", "2", "--strategy", "zero2"]),
           ("cp2 tp2 recompute", ["--cp", "2", "--tp", "2", "--recompute"])]
DIMS = ("dp", "cp", "pp", "tp", "tied")


def run(nproc, extra, steps, batch):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.json")
        cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(nproc), "-m", "ringcomm.train", *MODEL,
               "--steps", str(steps), "--batch-size", str(batch), "--metrics-json", path, *extra]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}:\n{result.stderr[-2000:]}")
        with open(path) as f:
            doc = json.load(f)
    rows = doc["per_rank"]
    return {"step_ms": 1e3 * max(r["step_time_s"] for r in rows),
            "saved_kib": max(r["saved_activation_bytes"] for r in rows) / 1024,
            "formula_kib": max(r["activation_formula_bytes"] for r in rows) / 1024,
            "peak_kib": max(r["peak_activation_bytes"] or 0 for r in rows) / 1024,
            **{f"{d}_kib": max(r[f"{d}_bytes_sent_per_step"] for r in rows) / 1024 for d in DIMS},
            **{f"{d}_formula_kib": max(r[f"{d}_bytes_predicted_per_step"] for r in rows) / 1024 for d in DIMS},
            "cp_compute_ms": 1e3 * statistics.mean(r["cp_compute_s_per_step"] for r in rows),
            "cp_wait_ms": 1e3 * statistics.mean(r["cp_wait_s_per_step"] for r in rows),
            "final_loss": doc["final_loss"], "param_sha256": doc["param_sha256"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    layouts = []
    print(f"GPT {' '.join(MODEL[2:10])}, global batch {args.batch_size} sequences, 4 ranks, {args.steps} steps")
    print(f"{'layout':<18}{'step ms':>8}{'saved act KiB':>19}{'peak KiB':>10}  "
          + "".join(f"{d + ' KiB/step':>20}" for d in DIMS))
    for name, extra in LAYOUTS:
        row = dict(layout=name, **run(4, extra, args.steps, args.batch_size))
        layouts.append(row)
        cells = "".join(f"{row[f'{d}_kib']:>9.1f}/{row[f'{d}_formula_kib']:<10.1f}" for d in DIMS)
        print(f"{name:<18}{row['step_ms']:>8.1f}{row['saved_kib']:>9.1f}/{row['formula_kib']:<9.1f}"
              f"{row['peak_kib']:>10.1f}  {cells}", flush=True)
    replica = 4  # sequences of one data-parallel replica, cut over C = 1, 2, 4 cp ranks
    scaling = []
    print(f"\ncontext parallelism, one replica of {replica} sequences of 128 positions")
    print(f"{'C':>3}{'step ms':>9}{'saved act KiB':>15}{'peak KiB':>10}{'attention ms':>14}{'exposed hop ms':>16}")
    for c in (1, 2, 4):
        extra = ["--cp", str(c), "--dp", "1"] + (["--strategy", "single"] if c == 1 else [])
        row = dict(cp=c, **run(c, extra, args.steps, replica))
        scaling.append(row)
        print(f"{c:>3}{row['step_ms']:>9.1f}{row['saved_kib']:>15.1f}{row['peak_kib']:>10.1f}"
              f"{row['cp_compute_ms']:>14.1f}{row['cp_wait_ms']:>16.1f}", flush=True)
    with open(os.path.join(args.out, "gpt_layouts.json"), "w") as f:
        json.dump({"model": MODEL, "batch_size": args.batch_size, "layouts": layouts, "cp_scaling": scaling}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["layout"] for r in layouts]
    a.barh(names, [r["saved_kib"] for r in layouts], label="saved for backward")
    a.barh(names, [r["peak_kib"] - r["saved_kib"] for r in layouts], left=[r["saved_kib"] for r in layouts],
           label="transients (traced peak)")
    a.set_xlabel("activation memory per rank (KiB, most loaded rank)")
    a.legend()
    a.invert_yaxis()
    cs = [r["cp"] for r in scaling]
    b.plot(cs, [r["saved_kib"] for r in scaling], "o-", label="saved activations")
    b.plot(cs, [scaling[0]["saved_kib"] / c for c in cs], "k--", label="1/C")
    b.set_xscale("log", base=2)
    b.set_yscale("log", base=2)
    b.set_xlabel("context-parallel ranks C")
    b.set_ylabel("KiB per rank")
    b.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "gpt_layouts.png"), dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
