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

The parts: :mod:`.expected` (every rank's inputs and what numpy says each collective must
give), :mod:`.record` (the checks, in the same order on every rank), :mod:`.collectives`
(parts 1 and 2) and :mod:`.throughput` (part 3); the report and the command line are here.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import ringcomm
from ringcomm.units import human, parse_size

from .collectives import BYTES_ACCOUNTING_SIZE, check_bytes, check_collectives
from .expected import DTYPES, KINDS, OPS, SEED, Inputs, compare, kind_of, ops_for, reduction
from .record import MAX_PRINTED_FAILURES, Checks, Fatal
from .throughput import bandwidth

__all__ = ["BYTES_ACCOUNTING_SIZE", "DEFAULT_TIMEOUT", "DTYPES", "KINDS", "MAX_PRINTED_FAILURES", "OPS", "SEED",
           "Checks", "Fatal", "Inputs", "bandwidth", "check_bytes", "check_collectives", "compare", "kind_of",
           "main", "ops_for", "print_report", "ranks", "reduction"]

DEFAULT_TIMEOUT = 60.0  # s per collective (a hang should not cost the default 5 min), unless RINGCOMM_TIMEOUT


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
