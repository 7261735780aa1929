"""Training comparison: every strategy's step time, peak model-state memory and bytes per
rank per step, at N = 2 and 4, plus DDP with and without overlapping communication.

    python bench/training.py [--world-sizes 2,4] [--steps 30] [--repeats 3] [--out bench/out]

Each configuration is a real job (``python -m ringcomm.launch --nproc N -m ringcomm.train
... --metrics-json``). Step time is the median step of rank 0 (ranks step in lock-step),
taken as the median over ``--repeats`` jobs; the DDP overlap comparison alternates the two
variants job by job so machine noise hits both alike, and reports the ratio. Writes
``training.json`` and ``training.png`` into ``--out``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

STRATEGIES = ["dp", "ddp", "zero1", "zero2", "zero3"]
MODEL = ["--layers", "256,1024,1024,1024,10", "--batch-size", "512", "--samples", "4096",
         "--precision", "fp16", "--bucket-mb", "1"]


def run_job(n, strategy, steps, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.json")
        cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(n), "-m", "ringcomm.train",
               "--strategy", strategy, "--steps", str(steps), "--metrics-json", path, *MODEL, *extra]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        with open(path) as f:
            return json.load(f)


def summarize(docs):
    rows = docs[0]["per_rank"]
    return {
        "step_time_s": statistics.median(d["per_rank"][0]["step_time_s"] for d in docs),
        "peak_bytes": max(r["peak_model_state_bytes"] for r in rows),
        "sent_per_step_rank0": rows[0]["bytes_sent"] / docs[0]["steps"],
        "sent_per_step_max": max(r["bytes_sent"] for r in rows) / docs[0]["steps"],
        "num_params": docs[0]["num_params"],
        "final_loss": docs[0]["final_loss"],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sizes = [int(s) for s in args.world_sizes.split(",")]
    results = {"model": MODEL, "steps": args.steps, "repeats": args.repeats, "strategies": {}, "overlap": {}}
    for n in sizes:
        for strategy in STRATEGIES:
            docs = [run_job(n, strategy, args.steps) for _ in range(args.repeats)]
            results["strategies"][f"{strategy}@{n}"] = summarize(docs)
            print(f"N={n} {strategy:6s} " + json.dumps(results["strategies"][f"{strategy}@{n}"]), flush=True)
        with_overlap, without = [], []
        for _ in range(args.repeats):  # alternate, so noise hits both alike
            with_overlap.append(run_job(n, "ddp", args.steps))
            without.append(run_job(n, "ddp", args.steps, ["--no-overlap"]))
        on, off = summarize(with_overlap)["step_time_s"], summarize(without)["step_time_s"]
        results["overlap"][str(n)] = {"overlap_s": on, "no_overlap_s": off, "saving": 1 - on / off}
    print_table(results, sizes)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, sizes, os.path.join(args.out, "training.png"))
    return 0


def print_table(results, sizes):
    print(f"\n{'strategy':<8}{'N':>3}{'step ms':>10}{'peak model state KiB':>22}{'sent/step/rank KiB (max)':>26}")
    for n in sizes:
        for s in STRATEGIES:
            r = results["strategies"][f"{s}@{n}"]
            print(f"{s:<8}{n:>3}{r['step_time_s'] * 1e3:>10.1f}{r['peak_bytes'] / 1024:>22.1f}"
                  f"{r['sent_per_step_max'] / 1024:>26.1f}")
    print(f"\n{'N':>3}{'ddp overlap ms':>16}{'no overlap ms':>15}{'saving':>8}")
    for n in sizes:
        o = results["overlap"][str(n)]
        print(f"{n:>3}{o['overlap_s'] * 1e3:>16.1f}{o['no_overlap_s'] * 1e3:>15.1f}{o['saving'] * 100:>7.1f}%")


def plot(results, sizes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / len(sizes)
    for k, n in enumerate(sizes):
        xs = [i + k * width for i in range(len(STRATEGIES))]
        rows = [results["strategies"][f"{s}@{n}"] for s in STRATEGIES]
        axes[0].bar(xs, [r["step_time_s"] * 1e3 for r in rows], width, label=f"N={n}")
        axes[1].bar(xs, [r["peak_bytes"] / 2 ** 20 for r in rows], width, label=f"N={n}")
        axes[2].bar(xs, [r["sent_per_step_max"] / 2 ** 20 for r in rows], width, label=f"N={n}")
    for ax, title in zip(axes, ["median step time (ms)", "peak model state per rank (MiB)",
                                "bytes sent per step, busiest rank (MiB)"], strict=True):
        ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(STRATEGIES))], STRATEGIES)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
