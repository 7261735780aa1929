"""What every benchmark in bench/ shares: sizes, closed-form inputs, nccl-tests metrics, output.

Conventions (those of nccl-tests):

- ``size`` is the bytes of the whole buffer a collective works on: the all-reduce,
  broadcast and reduce buffer; for reduce-scatter and all-gather the full n-rank buffer
  (``x`` of reduce-scatter, ``out`` of all-gather). ``count`` is the element count of the
  operation's parameter: the buffer for all-reduce, broadcast and reduce, one rank's part
  (size / n / itemsize) for reduce-scatter and all-gather.
- ``time`` is the median over the timed iterations (after warm-up) of the per-iteration
  time, which is the slowest rank's time for that iteration.
- ``algbw = size / time``; ``busbw = algbw * factor`` with factor 2(n-1)/n for all-reduce,
  (n-1)/n for reduce-scatter and all-gather, 1 for broadcast and reduce. GB/s = 1e9 B/s.
- ``#wrong`` counts result elements that differ from the closed form, summed over every
  iteration (warm-up included) and every rank. Rank r's input element i is
  ``v_r[i] = i % 13 + r + 1``: small integers, so every dtype holds every partial result
  exactly, and ``sum`` over n ranks is ``n*(i % 13) + n(n+1)/2``, ``max`` is ``i % 13 + n``
  and ``min`` is ``i % 13 + 1``.
"""
import csv
import json
import os
import platform
import re
import time
import timeit

import numpy as np

from ringcomm.units import parse_size

PERIOD = 13  # inputs repeat with this period: see input_for
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
           "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}
COLLECTIVES = tuple(FACTORS)
OPS = ("sum", "max", "min")


def parse_sizes(spec):
    """'1K:256M:x4' (from:to:xfactor, both ends included) or '4K,256K,4M' -> sorted bytes."""
    sizes = set()
    for part in spec.split(","):
        if not part.strip():
            continue
        if ":" not in part:
            sizes.add(parse_size(part))
            continue
        fields = part.split(":")
        if len(fields) != 3 or not re.fullmatch(r"\s*x\d+\s*", fields[2]):
            raise ValueError(f"not a size range: {part!r} (try 1K:256M:x4)")
        low, high, factor = parse_size(fields[0]), parse_size(fields[1]), int(fields[2].strip()[1:])
        if low < 1 or factor < 2 or high < low:
            raise ValueError(f"bad size range {part!r}: need 1 <= from <= to and factor >= 2")
        while low <= high:
            sizes.add(low)
            low *= factor
    if not sizes:
        raise ValueError(f"no sizes in {spec!r}")
    return sorted(sizes)


def parse_rate(text):
    """A tc rate ('1gbit', '500mbit', '100kbit', '1000000bit') -> bits per second."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a tc rate in bits: {text!r} (try 1gbit, 500mbit)")
    return float(match.group(1)) * 1000 ** " kmg".index(match.group(2).lower() or " ")


def busbw_factor(collective, n):
    return FACTORS[collective](n)


def metrics(collective, n, size_bytes, seconds):
    """(algbw, busbw) in GB/s for ``size_bytes`` moved in ``seconds``."""
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else float("inf")
    return algbw, algbw * busbw_factor(collective, n)


def input_for(rank, count, dtype, offset=0):
    """Rank ``rank``'s input: element i is (i + offset) % 13 + rank + 1."""
    return ((np.arange(offset, offset + count) % PERIOD) + (rank + 1)).astype(dtype)


def reduced(n, count, dtype, op="sum", offset=0):
    """The closed form of ``op`` over the inputs of ranks 0..n-1 (see input_for)."""
    base = np.arange(offset, offset + count) % PERIOD
    if op == "sum":
        return (n * base + n * (n + 1) // 2).astype(dtype)
    if op == "max":
        return (base + n).astype(dtype)
    if op == "min":
        return (base + 1).astype(dtype)
    raise ValueError(f"op {op!r} has no closed form here; use one of {OPS}")


def count_wrong(got, expected):
    return int(np.count_nonzero(got != expected))


def best_seconds(fn, number, repeat=5):
    """Seconds one call of ``fn`` takes at best: ``number`` calls timed together, the
    fastest of ``repeat`` such runs (``timeit``'s advice: the minimum is the least disturbed)."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def summarize(times_s):
    """Median, min and max of per-iteration times (seconds) in microseconds."""
    t = np.asarray(times_s, np.float64) * 1e6
    return {"time_us": float(np.median(t)), "time_us_min": float(t.min()),
            "time_us_max": float(t.max())}


def machine():
    """The machine a result was measured on: cores, CPU model, memory, kernel, Python, and
    the load average when it was asked (other work on the machine skews every number)."""
    model, mem_kib = "unknown", 0
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
        with open("/proc/meminfo") as f:
            mem_kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
    except (OSError, StopIteration, ValueError):
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model, "mem_gib": round(mem_kib / 2 ** 20, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "numpy": np.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def ringcomm_source():
    """Which ringcomm was measured: its version, directory and, in a git checkout, the commit."""
    import subprocess

    import ringcomm
    where = os.path.dirname(os.path.dirname(os.path.abspath(ringcomm.__file__)))
    try:
        commit = subprocess.run(["git", "-C", where, "describe", "--always", "--dirty"],
                                check=False, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"version": ringcomm.__version__, "path": where, "git": commit or None}


def write_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def write_csv(path, rows, columns):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def fmt_bw(value):
    return f"{value:.3f}" if value < 100 else f"{value:.1f}"


def fmt_time(us):
    return f"{us:.1f}" if us < 1e5 else f"{us:.0f}"


def row_prefix(size, count, type_name, redop, root):
    """The first five nccl-tests columns: size (B), count (elements), type, redop, root."""
    return f"{size:>12} {count:>12} {type_name:>8} {redop:>6} {root:>5}"


def header_prefix():
    return (f"#{'size':>11} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}",
            f"#{'(B)':>11} {'(elements)':>12} {'':>8} {'':>6} {'':>5}")


def metric_cells(cell):
    """time, algbw, busbw, #wrong for one measurement (a dict), or n/a."""
    if cell is None:
        return f"{'n/a':>10} {'':>7} {'':>7} {'':>7}"
    return (f"{fmt_time(cell['time_us']):>10} {fmt_bw(cell['algbw']):>7} "
            f"{fmt_bw(cell['busbw']):>7} {cell['wrong']:>7}")


def metric_header():
    return (f"{'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7}",
            f"{'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or ``None`` where matplotlib is
    missing (said once): a benchmark's numbers never depend on its picture."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (make install-bench installs it)")
        return None
    return plt
