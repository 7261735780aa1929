"""Check that every ringcomm collective gives the right answer here, then measure it.

Run on every rank through the launcher::

    python -m ringcomm.launch --nproc 4 -m ringcomm.selfcheck                # 5-15 s
    python -m ringcomm.launch --nproc 4 -m ringcomm.selfcheck --quick --json out.json

Three parts; rank 0 prints, the other ranks speak only to report a failure:

1. **Correctness.** Every collective (all_reduce, reduce_scatter, all_gather, broadcast and
   reduce from every root, barrier, send/recv around the ring, all_reduce in a group of the
   even ranks) with every algorithm, several dtypes, lengths and ops. Inputs are a pure
   function of (seed, rank, dtype, length): every rank computes the expected result with
   numpy, without communication. Integers and max/min must match exactly, float sums within
   a few ulps per rank; all-reduce results bitwise on every rank (crc32s all-gathered).
2. **Byte accounting.** ``stats()["bytes_sent"]`` after one 1 MiB all-reduce must follow the
   formulas: ring 2(n-1)S in total, about 2(n-1)S/n per rank; parameter server (n-1)S on
   rank 0 and S on every other rank.
3. **Bandwidth.** Ring against parameter-server all-reduce at a few sizes, nccl-tests style.

A *check* is one collective call verified on every rank; it fails if any rank saw a wrong
result. The exit status is 0 only if every check passed; a rank whose own check failed prints
the collective, algorithm, dtype, length and first wrong element on stderr. If a collective
raises, every rank stops there (the group may no longer be in step). Each collective may
take 60 s unless ``RINGCOMM_TIMEOUT`` (``launch --timeout``) says otherwise.
"""
import argparse
import json
import os
import sys
import time
import traceback
import zlib

import numpy as np

import ringcomm
from ringcomm.kernels.reference import BITWISE, UFUNCS
from ringcomm.units import human, parse_size

SEED = 20240521
OPS = tuple(UFUNCS)  # every reduce op
DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.float16))
KINDS = ("sum", "extreme", "prod")  # input value ranges, chosen by op
BYTES_ACCOUNTING_SIZE = 1 << 20
MAX_PRINTED_FAILURES = 20
DEFAULT_TIMEOUT = 60.0  # s per collective (a hang should not cost the default 5 min), unless RINGCOMM_TIMEOUT


class Fatal(Exception):
    """A collective raised: the ranks may no longer agree on what runs next, so stop."""


class Inputs:
    """Every rank's input buffer; row r of ``stack(...)`` is what rank r passes in."""

    def __init__(self, n, seed):
        self.n, self.seed, self._cache = n, seed, {}

    def stack(self, dtype, length, kind):
        key = (dtype, length, kind)
        if key not in self._cache:
            rows = [self._make(r, dtype, length, kind) for r in range(self.n)]
            self._cache[key] = np.stack(rows)
        return self._cache[key]

    def clear(self):
        self._cache.clear()

    def _make(self, rank, dtype, length, kind):
        rng = np.random.default_rng([self.seed, rank, length, dtype.num, KINDS.index(kind)])
        if dtype.kind == "i":
            low, high = {"sum": (-1000, 1001), "extreme": (-2 ** 30, 2 ** 30), "prod": (-3, 4)}[kind]
            return rng.integers(low, high, length, dtype=dtype)
        if kind == "prod":  # magnitudes near 1 so that products stay in range
            values = rng.uniform(0.5, 1.5, length) * rng.choice([-1.0, 1.0], length)
        else:
            values = rng.uniform(-1.0, 1.0, length) * (100.0 if kind == "extreme" else 1.0)
        return values.astype(dtype)


def kind_of(op):
    return {"sum": "sum", "avg": "sum", "prod": "prod"}.get(op, "extreme")


def ops_for(dtype):
    return [op for op in OPS if (op != "avg" or dtype.kind == "f") and (op not in BITWISE or dtype.kind != "f")]


def reduction(stack, op):
    """The expected result of ``op`` over the rows of ``stack`` and an elementwise tolerance
    (None: must match exactly). Floats are reduced in float64; ranks may reduce in another
    order and in the buffer's own precision, hence about 2n ulps per operand magnitude."""
    n, dtype = stack.shape[0], stack.dtype
    if dtype.kind != "f":
        return UFUNCS[op].reduce(stack, axis=0), None
    wide = stack.astype(np.float64)
    expected = UFUNCS[op].reduce(wide, axis=0)
    if op in ("max", "min"):
        return expected, None
    eps = float(np.finfo(dtype).eps)
    scale = np.abs(expected) if op == "prod" else np.abs(wide).sum(axis=0)
    if op == "avg":
        expected, scale = expected / n, scale / n
    return expected, 2 * n * eps * scale + eps * np.abs(expected) + float(np.finfo(dtype).tiny)


def compare(got, expected, tol=None):
    """None if ``got`` matches, else a sentence naming the first wrong element."""
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    # with a tolerance, NaN counts as wrong: it is never within one
    bad = (got.astype(expected.dtype) != expected if tol is None
           else ~(np.abs(got.astype(np.float64) - expected) <= tol))
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    return (f"{int(bad.sum())} of {bad.size} elements wrong; first at index {i}: "
            f"expected {expected[i].item()!r}, got {got[i].item()!r}")


class Checks:
    """Records checks in the same order on every rank, so they can be merged by index."""

    def __init__(self, comm):
        self.comm, self.rows, self.failed, self.names, self.printed = comm, {}, [], [], 0

    def add(self, collective, algorithm, label, error):
        index = len(self.failed)
        self.rows.setdefault((collective, algorithm), []).append(index)
        self.failed.append(False)
        self.names.append(f"{collective} algorithm={algorithm} {label}")
        if error:
            self.fail(index, error)
        return index

    def fail(self, index, error):
        self.failed[index] = True
        if self.printed < MAX_PRINTED_FAILURES:
            print(f"selfcheck: rank {self.comm.rank}: FAIL {self.names[index]}: {error}", file=sys.stderr, flush=True)
        elif self.printed == MAX_PRINTED_FAILURES:
            print(f"selfcheck: rank {self.comm.rank}: more failures not shown", file=sys.stderr)
        self.printed += 1

    def call(self, what, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not getattr(exc, "remote", False):  # this rank raised it first: show where
                traceback.print_exc()
            index = self.add(*what, f"raised {type(exc).__name__}: {exc}")
            raise Fatal(self.names[index]) from exc


def check_collectives(comm, checks, inputs, lengths):
    """Every verb and algorithm against numpy, in this order on every rank (the calls pair
    by their order): all-reduce, then the rooted and gathering collectives, barriers,
    send/recv and a sub-group."""
    _check_all_reduce(comm, checks, inputs, lengths)
    _check_rooted_and_gathers(comm, checks, inputs, lengths)
    _check_barriers(comm, checks)
    if comm.world_size > 1:
        _check_send_recv(comm, checks, inputs, lengths)
    _check_group(comm, checks, inputs, lengths)


def _check_all_reduce(comm, checks, inputs, lengths):
    """Each dtype, length and op on every algorithm, and the results bitwise alike on every
    rank (their crc32s gathered)."""
    n, r = comm.world_size, comm.rank
    algos = ["ring", "ps", "auto"] + (["rd"] if n & (n - 1) == 0 else [])
    crcs = []  # (check index, crc32 of this rank's all_reduce result)
    for algo in algos:
        for dt in DTYPES:
            for length in lengths:
                for op in ops_for(dt):
                    stack = inputs.stack(dt, length, kind_of(op))
                    x = stack[r].copy()
                    label = f"dtype={dt} length={length} op={op}"
                    checks.call(("all_reduce", algo, label), comm.all_reduce, x, op, algo)
                    index = checks.add("all_reduce", algo, label, compare(x, *reduction(stack, op)))
                    crcs.append((index, zlib.crc32(x.tobytes())))
    every = np.empty(n * len(crcs), np.int64)
    checks.call(("all_gather", "auto", "of all_reduce checksums"), comm.all_gather,
                every, np.array([c for _, c in crcs], np.int64))
    for (index, _), column in zip(crcs, every.reshape(n, -1).T, strict=True):
        if r == 0 and len(set(column.tolist())) > 1:  # rank 0 reports it for everyone
            checks.fail(index, f"results differ across ranks (crc32 by rank: {column.tolist()})")
    inputs.clear()


def _check_rooted_and_gathers(comm, checks, inputs, lengths):
    """reduce_scatter, all_gather, broadcast from every root and reduce to every root."""
    n, r = comm.world_size, comm.rank
    big = max(lengths)
    for algo in ("ring", "ps", "auto"):
        for dt in DTYPES:
            for length in lengths:
                m = min(length, big * 4 // n)  # per-rank share; x holds n * m elements
                for op in ops_for(dt):
                    stack = inputs.stack(dt, n * m, kind_of(op))
                    out, x = np.empty(m, dt), stack[r].copy()
                    label = f"dtype={dt} length={n * m} op={op}"
                    checks.call(("reduce_scatter", algo, label), comm.reduce_scatter, out, x, op, algo)
                    expected, tol = reduction(stack, op)
                    part = slice(r * m, (r + 1) * m)
                    checks.add("reduce_scatter", algo, label, compare(out, expected[part], None
                               if tol is None else tol[part]) or compare(x, stack[r]) and "x was modified")
                stack = inputs.stack(dt, m, "extreme")
                out, label = np.empty(n * m, dt), f"dtype={dt} length={m}"
                checks.call(("all_gather", algo, label), comm.all_gather, out, stack[r].copy(), algo)
                checks.add("all_gather", algo, label, compare(out, stack.reshape(-1)))
            for length in lengths:
                for root in range(n):
                    stack = inputs.stack(dt, length, "extreme")
                    x, label = stack[r].copy(), f"dtype={dt} length={length} root={root}"
                    checks.call(("broadcast", algo, label), comm.broadcast, x, root, algo)
                    checks.add("broadcast", algo, label, compare(x, stack[root]))
                    op = ops_for(dt)[(root + lengths.index(length)) % len(ops_for(dt))]
                    stack = inputs.stack(dt, length, kind_of(op))
                    x, label = stack[r].copy(), f"{label} op={op}"
                    checks.call(("reduce", algo, label), comm.reduce, x, root, op, algo)
                    error = compare(x, *reduction(stack, op)) if r == root else \
                        compare(x, stack[r]) and "x changed on a rank that is not the root"
                    checks.add("reduce", algo, label, error)
        inputs.clear()


def _check_barriers(comm, checks):
    """Each rank late in turn: no rank leaves a barrier before the last one entered it."""
    n, r = comm.world_size, comm.rank
    stamps, barrier_checks = [], []
    for algo in ("ring", "ps", "auto"):
        for late in range(n):  # rank `late` enters 10 ms after the others
            if r == late:
                time.sleep(0.01)
            t_in = time.perf_counter()
            checks.call(("barrier", algo, f"late rank {late}"), comm.barrier, algo)
            stamps += [t_in, time.perf_counter()]
            barrier_checks.append(checks.add("barrier", algo, f"late rank {late}", None))
    every = np.empty(n * len(stamps), np.float64)
    checks.call(("all_gather", "auto", "of barrier times"), comm.all_gather, every, np.array(stamps))
    if r == 0 and comm.local_world_size == n:  # one host: perf_counter agrees between processes
        for index, times in zip(barrier_checks, every.reshape(n, -1, 2).transpose(1, 0, 2), strict=True):
            if times[:, 1].min() < times[:, 0].max():
                checks.fail(index, f"a rank left at {times[:, 1].min():.6f} before the last "
                                   f"entered at {times[:, 0].max():.6f}")


def _check_send_recv(comm, checks, inputs, lengths):
    """Each rank sends to its right and receives from its left, one tag per length."""
    n, r = comm.world_size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    for dt in DTYPES:
        for tag, length in enumerate(lengths):
            stack, label = inputs.stack(dt, length, "extreme"), f"dtype={dt} length={length}"
            got = np.empty(length, dt)
            work = checks.call(("send/recv", "-", label), comm.send, stack[r], right, tag, True)
            checks.call(("send/recv", "-", label), comm.recv, got, left, tag)
            checks.call(("send/recv", "-", label), work.wait)
            checks.add("send/recv", "-", label, compare(got, stack[left]))


def _check_group(comm, checks, inputs, lengths):
    """A sub-group of the even ranks all-reduces on every algorithm; the odd ranks, left
    out, still record the checks (with no error) so every rank lists the same ones."""
    n = comm.world_size
    members = list(range(0, n, 2))
    group = checks.call(("new_group", "-", f"ranks {members}"), comm.new_group, members)
    for algo in ("ring", "ps", "auto"):
        for dt in DTYPES:
            for i, length in enumerate(lengths):
                op = ops_for(dt)[i % len(ops_for(dt))]
                stack = inputs.stack(dt, length, kind_of(op))[members]
                label, error = f"ranks={members} dtype={dt} length={length} op={op}", None
                if group is not None:
                    x = stack[group.rank].copy()
                    checks.call(("group all_reduce", algo, label), group.all_reduce, x, op, algo)
                    error = compare(x, *reduction(stack, op))
                checks.add("group all_reduce", algo, label, error)
    inputs.clear()


def check_bytes(comm, checks):
    """Bytes sent by one ring and one PS all-reduce of S bytes, against the formulas."""
    n, S = comm.world_size, BYTES_ACCOUNTING_SIZE
    x, result = np.ones(S // 4, np.float32), {"size_bytes": S}
    for algo in ("ring", "ps"):
        comm.reset_stats()
        checks.call(("bytes", algo, f"all_reduce of {S} B"), comm.all_reduce, x, "sum", algo)
        mine, every = np.array([comm.stats()[k] for k in ("bytes_sent", "bytes_received")]), np.empty(2 * n, np.int64)
        checks.call(("bytes", algo, "all_gather of stats"), comm.all_gather, every, mine)
        sent, received = every[0::2].tolist(), every[1::2].tolist()
        if algo == "ring":  # chunks differ by at most one element, hence the slack per rank
            per_rank, slack = 2 * (n - 1) * S / n, 2 * (n - 1) * x.itemsize
            ok = sum(sent) == 2 * (n - 1) * S and all(abs(s - per_rank) <= slack for s in sent)
            expected = {"total": 2 * (n - 1) * S, "per_rank": per_rank}
        else:
            want = [(n - 1) * S] + [S] * (n - 1)
            ok, expected = sent == want, {"rank0": (n - 1) * S, "others": S if n > 1 else None}
        ok = ok and sum(received) == sum(sent)
        checks.add("bytes", algo, f"all_reduce of {S} B", None if ok or comm.rank else  # rank 0 tells
                   f"bytes_sent by rank {sent}, bytes_received {received}; expected {expected}")
        result[algo] = {"bytes_sent": sent, "bytes_received": received, "expected": expected, "ok": ok}
    return result


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


def ranks(n):
    return f"{n} rank{'s' if n != 1 else ''}"


def print_report(n, table, accounting, bw, iters):
    print("\ncorrectness: a check is one collective call whose result every rank verified")
    print(f"{'collective':<18} {'algorithm':<9} {'checks':>7} {'failures':>8}")
    for row in table:
        print(f"{row['collective']:<18} {row['algorithm']:<9} {row['checks']:>7} {row['failures']:>8}")
    S = accounting["size_bytes"]
    print(f"\nbyte accounting: bytes_sent after one all_reduce of S = {human(S)} on n = {ranks(n)}")
    ring, ps = accounting["ring"], accounting["ps"]
    print(f"  ring  by rank {ring['bytes_sent']}: total {sum(ring['bytes_sent'])}, formula 2(n-1)S = "
          f"{2 * (n - 1) * S}; per rank formula 2(n-1)S/n = {2 * (n - 1) * S / n:.0f}  "
          f"[{'ok' if ring['ok'] else 'MISMATCH'}]")
    print(f"  ps    by rank {ps['bytes_sent']}: formula rank 0 (n-1)S = {(n - 1) * S}"
          f"{f', others S = {S}' if n > 1 else ''}  [{'ok' if ps['ok'] else 'MISMATCH'}]")
    if bw is None:
        print("\nbandwidth: skipped, there is nothing to measure with 1 rank")
        return
    print(f"\nall_reduce bandwidth, ring vs parameter server (ps), {ranks(n)}: time = median over {iters} "
          f"iterations of the slowest rank\nalgbw = size / time, busbw = algbw * 2(n-1)/n = algbw * "
          f"{2 * (n - 1) / n:.3g}; ps/ring > 1: the ring is faster; #wrong = wrong result elements, all ranks")
    print(f"#{'':>32}{'ring':^26}  {'ps':^26}")
    head = f"{'time':>10}{'algbw':>8}{'busbw':>8}", f"{'(us)':>10}{'(GB/s)':>8}{'(GB/s)':>8}"
    print(f"#{'size':>11}{'count':>12}{'type':>9}{head[0]}  {head[0]}{'ps/ring':>9}{'#wrong':>8}")
    print(f"#{'(B)':>11}{'(elements)':>12}{'':>9}{head[1]}  {head[1]}{'(time)':>9}")
    for row in bw:
        cells = "  ".join(f"{row[a]['time_us']:>10.1f}{row[a]['algbw']:>8.3f}{row[a]['busbw']:>8.3f}"
                          for a in ("ring", "ps"))
        print(f" {row['size_bytes']:>11}{row['count']:>12}{row['type']:>9}{cells}"
              f"{row['ratio']:>9.2f}{row['wrong']:>8}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ringcomm.selfcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths and sizes (a few seconds)")
    parser.add_argument("--sizes", type=lambda s: [parse_size(p) for p in s.split(",") if p.strip()],
                        help="bandwidth table sizes in bytes, comma separated "
                             "(default 4KiB,256KiB,4MiB,16MiB; --quick: 4KiB,1MiB)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per size (default 5)")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of every rank's inputs")
    parser.add_argument("--json", metavar="FILE", help="rank 0 writes the results here")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    sizes = args.sizes or ([4 << 10, 1 << 20] if args.quick else [4 << 10, 256 << 10, 4 << 20, 16 << 20])

    started = time.perf_counter()
    comm = ringcomm.init(timeout=None if "RINGCOMM_TIMEOUT" in os.environ else DEFAULT_TIMEOUT)
    n, r = comm.world_size, comm.rank
    if r == 0:
        print(f"ringcomm selfcheck: {ranks(n)}, seed {args.seed}{', quick' if args.quick else ''}", flush=True)
    lengths = sorted({0, 1, max(n - 1, 0), 1009} | ({100_003} if not args.quick else {10_007}))
    checks = Checks(comm)
    try:
        check_collectives(comm, checks, Inputs(n, args.seed), lengths)
        accounting = check_bytes(comm, checks)
        bw = bandwidth(comm, checks, sizes, args.iters) if n > 1 else None
    except Fatal as exc:  # the other ranks cannot be relied on to take part any more
        message = f"stopped after an exception in {exc}"
        if r == 0:
            print(f"\nselfcheck: FAILED ({sum(checks.failed)} of {len(checks.failed)} checks; {message})")
        else:
            print(f"selfcheck: rank {r}: {message}", file=sys.stderr)
        return 1
    failed = np.array(checks.failed, np.uint8)  # a check fails if it failed on any rank
    comm.all_reduce(failed, op="max", algorithm="ps")
    order = list(dict.fromkeys(c for c, _ in checks.rows))  # collectives in the order run
    table = [{"collective": c, "algorithm": a, "checks": len(idx), "failures": int(failed[idx].sum())}
             for (c, a), idx in sorted(checks.rows.items(), key=lambda item: order.index(item[0][0]))]
    total, bad = len(failed), int(failed.sum())
    if r == 0:
        print_report(n, table, accounting, bw, args.iters)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": n, "seed": args.seed, "quick": args.quick,
                           "passed": bad == 0, "checks": total, "failures": bad,
                           "failed_checks": [checks.names[i] for i in np.flatnonzero(failed)],
                           "collectives": table, "byte_accounting": accounting,
                           "bandwidth": bw, "elapsed_s": time.perf_counter() - started}, f, indent=1)
        print(f"\nselfcheck: PASSED ({total} checks)" if bad == 0 else
              f"\nselfcheck: FAILED ({bad} of {total} checks)")
    comm.close()
    return 1 if any(checks.failed) or (r == 0 and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
