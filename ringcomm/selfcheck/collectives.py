"""The self-check's correctness checks (parts 1 and 2 of :mod:`ringcomm.selfcheck`): every
collective with every algorithm against numpy, then the bytes one all-reduce sends against
the formulas. Every rank makes the same calls in the same order (the calls pair by their
order), and records a check for each even where it has nothing to verify.

>>> checks = Checks(comm)
>>> check_collectives(comm, checks, Inputs(comm.world_size, SEED), lengths=[0, 1, 1009])
>>> accounting = check_bytes(comm, checks)      # {"size_bytes": S, "ring": {...}, "ps": {...}}
"""
import time
import zlib

import numpy as np

from .expected import DTYPES, compare, kind_of, ops_for, reduction

BYTES_ACCOUNTING_SIZE = 1 << 20


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
