"""The self-check's bandwidth table (part 3 of :mod:`ringcomm.selfcheck`): ring against
parameter-server all-reduce at a few sizes, nccl-tests style. Each result is verified too,
so a schedule that is fast because it is wrong shows up as a failed check.

>>> rows = bandwidth(comm, Checks(comm), sizes=[4 << 10, 1 << 20], iters=5)
>>> rows[0]["ring"]["busbw"], rows[0]["ratio"]          # GB/s, ps time / ring time
"""
import time

import numpy as np


def bandwidth(comm, checks, sizes, iters):
    """Median (over iterations) of the slowest rank's all-reduce time, ring and PS."""
    n, r, rows = comm.world_size, comm.rank, []
    for size in sizes:
        count = max(1, size // 4)
        pattern = np.arange(count) % 7
        base = (pattern + r).astype(np.float32)
        expected = (n * pattern + n * (n - 1) // 2).astype(np.float32)  # exact in float32
        row, wrong = {"size_bytes": count * 4, "count": count, "type": "float32"}, 0
        for algo in ("ring", "ps"):
            x, times = base.copy(), np.empty(iters)
            for i in range(-1, iters):  # i == -1: warm-up, not timed
                x[...] = base
                comm.barrier()
                start = time.perf_counter()
                checks.call(("bandwidth", algo, f"{count * 4} B"), comm.all_reduce, x, "sum", algo)
                if i >= 0:
                    times[i] = time.perf_counter() - start
                wrong += int(np.count_nonzero(x != expected))
            comm.all_reduce(times, op="max", algorithm="ring")
            t = float(np.median(times))
            algbw = count * 4 / t / 1e9
            row[algo] = {"time_us": t * 1e6, "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n}
        total = np.array([wrong], np.int64)
        comm.all_reduce(total, op="sum", algorithm="ring")
        row["wrong"] = int(total[0])
        checks.add("bandwidth", "ring+ps", f"size={count * 4}", wrong and f"{wrong} wrong elements")
        row["ratio"] = row["ps"]["time_us"] / row["ring"]["time_us"]
        rows.append(row)
    return rows
