"""Does overlapping communication with backward save time? DDP with and without overlap on
an emulated cluster, where the network (not the CPU) is the limit.

    sudo python bench/cluster_training.py [--world-size 2] [--rate 1gbit] [--steps 12]
                                          [--repeats 3] [--out bench/out]

On one host, loopback is so fast that communication is CPU work, and with every core busy
computing, overlap has nothing to hide behind (bench/training.py shows this). Here each rank
runs in its own network namespace with a rate-limited link (bench/netns.py builds it), so
a bucket's all-reduce is mostly waiting for the wire, and DDP can run it while backward
computes the next layers. Each repeat runs the two variants back to back (alternating, so
noise hits both); the step time is rank 0's median step. Connections between the namespaces
are encrypted (CURVE), as ringcomm does by default across hosts. Writes ``cluster_training.json``.
"""
import argparse
import json
import os
import signal
import statistics
import sys
import tempfile

import netns

PORT = 29611

MODEL = ["--layers", "256,1024,1024,1024,1024,10", "--batch-size", "256", "--samples", "2048",
         "--bucket-mb", "1"]


def train(cluster, steps, extra, timeout=600):
    """The metrics document of one ``python -m ringcomm.train`` job of MODEL on ``cluster``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.json")
        os.chmod(tmp, 0o777)
        try:
            netns.run(cluster, ["-m", "ringcomm.train", "--steps", str(steps), "--metrics-json", path, *MODEL, *extra],
                      PORT, timeout)
            with open(path) as f:
                return json.load(f)
        finally:
            netns.kill_started()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = p.parse_args(argv)
    why = netns.preflight()
    if why:
        print(f"cluster_training: cannot build the emulated cluster: {why}", file=sys.stderr)
        return 2
    cluster = netns.Cluster(args.world_size, 1, args.rate)  # a host per rank
    results = {"world_size": args.world_size, "rate": args.rate, "model": [*MODEL, "--strategy", "ddp"],
               "overlap": [], "no_overlap": []}
    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)  # so that the finally below removes the namespaces
    try:
        cluster.build()
        for _ in range(args.repeats):
            for key, extra in (("overlap", []), ("no_overlap", ["--no-overlap"])):
                doc = train(cluster, args.steps, ["--strategy", "ddp", *extra])
                results[key].append(doc["per_rank"][0]["step_time_s"])
                print(f"{key:10s} step {doc['per_rank'][0]['step_time_s'] * 1e3:7.1f} ms  "
                      f"(sent/step {doc['per_rank'][0]['bytes_sent_per_step'] / 2**20:.1f} MiB)", flush=True)
    finally:
        cluster.close()
    on, off = statistics.median(results["overlap"]), statistics.median(results["no_overlap"])
    results.update(overlap_s=on, no_overlap_s=off, saving=1 - on / off)
    print(f"\nDDP on {args.world_size} ranks, {args.rate} links: overlap {on * 1e3:.1f} ms/step, "
          f"no overlap {off * 1e3:.1f} ms/step: overlap saves {100 * (1 - on / off):.1f} %")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cluster_training.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
