"""One rank of the stress job (bench/stress.py): thousands of mixed calls back to back, each
checked against numpy, while the driver stops ranks at random and hogs the cores.

    RANK=r WORLD_SIZE=n ... python bench/stress_worker.py --seed S --ops K --report R.json

Every rank draws the same :class:`stress_plan.Plan` from ``--seed`` and runs its steps:
synchronous collectives, queues of up to 64 ``async_op`` calls, send/recv rounds, calls on
sub-groups (members only, interleaved with the world's in the plan's one order), new groups
mid-run, queues whose root comes late, calls that must fail with CollectiveMismatch (counted
as ``mismatches``; a success there is a wrong result), and, with ``--torch-port``, torch.distributed verbs on the "ringcomm" backend in
this same process (:mod:`stress_torch`). It stops at the first exception (after one, the
ranks no longer agree on what comes next), reports it, and exits 1.

The report (JSON): ops planned for this rank and done, wrong results (with the first few),
exceptions, peak RSS (``ru_maxrss``) beside the baseline measured before the stress starts
and README's bound, ``W × B_max + 64 MiB × tags in use`` per peer and communicator, plus what
this process's own buffers held at most (see :func:`bound`).
"""
import argparse
import dataclasses
import json
import os
import resource
import sys
import time
import traceback
from collections import Counter, defaultdict

import numpy as np

import ringcomm
from stress_plan import Plan, buffer_bytes, data, expected, kind_of, peer_bytes, same_bits, sizes

P2P_WINDOW = int(os.environ.get("RINGCOMM_P2P_WINDOW_BYTES", 64 << 20))
WINDOW = int(os.environ.get("RINGCOMM_COLLECTIVE_WINDOW", 16))
AGREE_EVERY = 32  # --seconds: steps between two agreements on whether time is up


def rss_kib():
    """This process's resident set now, and its peak so far (KiB)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0])
    fields["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return fields


class Rank:
    """This rank's communicators (index as in the plan; None where it is not a member), and
    the tallies the report is made of."""

    def __init__(self, comm, plan, seed):
        self.world, self.plan, self.seed = comm, plan, seed
        self.me = comm.rank
        self.comms = [comm]
        self.done = Counter()       # (verb, algorithm) -> calls done and checked
        self.planned = 0
        self.wrong = []             # the first few wrong results, described
        self.n_wrong = 0
        self.b_max = defaultdict(int)   # comm index -> README's B_max (an upper bound)
        self.tags = defaultdict(set)    # comm index -> point-to-point tags used
        self.app_peak = 0           # bytes this process's own buffers held at most
        self.mismatches = 0         # CollectiveMismatch raised where the plan asked for one

    # -- membership -----------------------------------------------------------------------
    def members(self, item):
        return self.plan.groups[item.comm]

    def takes_part(self, item):
        members = self.members(item)
        if self.me not in members:
            return False
        if item.verb == "p2p":
            return members.index(self.me) in (item.src, item.dst)
        return True

    def make_group(self, step):
        members = list(step.members)
        if step.members_only:
            group = self.world.new_group(members, members_only=True) if self.me in members else None
        else:
            group = self.world.new_group(members)
        self.comms.append(group)

    # -- one call ---------------------------------------------------------------------------
    def start(self, item, async_op):
        """Make ``item``'s buffers and start it: (work or None, {name: buffer}, {name: value
        it must keep}) — the second dict's buffers are compared with expected() after it
        completes, the third's with what they held before (inputs a verb must not write)."""
        c, members = self.comms[item.comm], self.members(item)
        g, r = len(members), members.index(self.me)
        n_in, n_out = sizes(item, g)[r]
        k, v = kind_of(item.verb), item.verb
        own = data(self.seed, item, r, n_in, k)

        def garbage(count):
            return data(self.seed, item, r, count, "garbage")
        self.b_max[item.comm] = max(self.b_max[item.comm], peer_bytes(item, g))
        bufs, keep, a = {}, {}, async_op
        if v == "all_reduce":
            x = own.reshape(2, -1) if item.shape2d else own
            bufs["x"] = x
            work = c.all_reduce(x, op=item.op, algorithm=item.alg, async_op=a)
        elif v == "reduce_scatter":
            if item.in_place:
                out = own[r * item.m:(r + 1) * item.m]
            else:
                out, keep["x"] = garbage(n_out), own.copy()
            bufs.update(out=out, x=own)
            work = c.reduce_scatter(out, own, op=item.op, algorithm=item.alg, async_op=a)
        elif v == "all_gather":
            out = garbage(n_out)
            x = own
            if item.in_place:
                out[r * item.m:(r + 1) * item.m] = own
                x = out[r * item.m:(r + 1) * item.m]
            else:
                keep["x"] = own.copy()
            bufs.update(out=out, x=x)
            work = c.all_gather(out, x, algorithm=item.alg, async_op=a)
        elif v == "broadcast":
            x = own if r == item.root else garbage(n_in)
            x = x.reshape(2, -1) if item.shape2d else x
            bufs["x"] = x
            work = c.broadcast(x, root=item.root, algorithm=item.alg, async_op=a)
        elif v == "reduce":
            bufs["x"] = own
            work = c.reduce(own, root=item.root, op=item.op, algorithm=item.alg, async_op=a)
        elif v == "gather":
            out = garbage(n_out) if r == item.root or not item.none_elsewhere else None
            if out is not None and r != item.root:
                keep["out"] = out.copy()  # "not used" off the root: must stay as it was
            bufs.update(out=out, x=own)
            keep["x"] = own.copy()
            work = c.gather(out, own, root=item.root, algorithm=item.alg, async_op=a)
        elif v == "scatter":
            out = garbage(n_out)
            x = data(self.seed, item, r, n_in, k) if r == item.root else \
                (None if item.none_elsewhere else garbage(n_in))
            if x is not None:
                keep["x"] = x.copy()
            bufs.update(out=out, x=x)
            work = c.scatter(out, x, root=item.root, algorithm=item.alg, async_op=a)
        elif v == "all_to_all":
            out = garbage(n_out)
            keep["x"] = own.copy()
            bufs.update(out=out, x=own)
            if item.splits is None:
                work = c.all_to_all(out, own, algorithm=item.alg, async_op=a)
            else:
                ins = list(item.splits[r])
                outs = [item.splits[s][r] for s in range(g)]
                work = c.all_to_all(out, own, out_splits=outs, in_splits=ins, algorithm=item.alg, async_op=a)
        elif v == "barrier":
            work = c.barrier(algorithm=item.alg, async_op=a)
        else:
            raise AssertionError(f"not a collective: {v}")
        self.app_peak = max(self.app_peak, buffer_bytes(item, g) + sum(x.nbytes for x in keep.values()))
        return (work if a else None), bufs, keep

    def start_p2p(self, item, direction, async_op):
        c, members = self.comms[item.comm], self.members(item)
        r = members.index(self.me)
        self.tags[item.comm].add(item.tag)
        if direction == "send":
            x = data(self.seed, item, item.src, item.m, "move")
            work = c.send(x, dst=item.dst, tag=item.tag, async_op=async_op)
            return (work if async_op else None), {}, {"x": x.copy()}
        x = data(self.seed, item, r, item.m, "garbage")
        work = c.recv(x, src=item.src, tag=item.tag, async_op=async_op)
        return (work if async_op else None), {"x": x}, {}

    def check(self, item, bufs, keep):
        """Count the call done; a wrong buffer counts once per call."""
        members = self.members(item)
        g, r = len(members), members.index(self.me)
        if item.verb == "p2p":
            want = {"x": data(self.seed, item, item.src, item.m, "move")} if r == item.dst else {}
        else:
            want = expected(self.seed, item, g, r)
        if item.verb in ("all_reduce", "reduce_scatter", "reduce", "all_gather", "all_to_all"):
            # the numpy oracle holds every rank's input at once while it computes
            self.app_peak = max(self.app_peak, (g + 2) * buffer_bytes(item, g))
        problems = [f"{name}: {describe(bufs[name], value)}" for name, value in want.items()
                    if not same_bits(bufs[name], value)]
        problems += [f"{name} (must be unchanged): {describe(bufs[name], value)}" for name, value in keep.items()
                     if name not in want and bufs.get(name) is not None and not same_bits(bufs[name], value)]
        if problems:
            self.n_wrong += 1
            if len(self.wrong) < 10:
                self.wrong.append({"item": describe_item(item, members), "rank_in_group": r,
                                   "problems": problems})
        self.done[(item.verb, item.alg if item.verb != "p2p" else "-")] += 1

    # -- steps ------------------------------------------------------------------------------
    def run_step(self, step, torch_slice):
        if step.kind == "group":
            self.make_group(step)
            return
        mine = [i for i in step.items if self.takes_part(i)] if step.kind != "torch" else step.items
        if step.kind == "torch":
            self.planned += sum(torch_slice.takes_part(i) for i in step.items)
            for item in step.items:
                if torch_slice.takes_part(item):
                    self._tally_torch(item, torch_slice.run(item))
            return
        self.planned += len(mine)
        if step.kind == "agree":  # an all-reduce max of every rank's "my time is up"
            flag = np.array([step.time_is_up], np.int32)
            self.world.all_reduce(flag, op="max")
            self.done[("agree", "auto")] += 1
            return bool(flag[0])
        if step.kind == "mismatch":
            self.run_mismatch(step, mine)
            return None
        if step.kind == "sync":
            for item in mine:
                _, bufs, keep = self.start(item, async_op=False)
                self.check(item, bufs, keep)
        elif step.kind == "p2p" and step.blocking:
            # sends first (each returns once its data is on its way: the window holds far
            # more than one round), then the receives, both in the plan's order
            sent = [(i, self.start_p2p(i, "send", False)) for i in mine if self._role(i) == "send"]
            got = [(i, self.start_p2p(i, "recv", False)) for i in mine if self._role(i) == "recv"]
            for item, (_, bufs, keep) in sent + got:
                self.check(item, bufs, keep)
        else:  # an async queue (a batch, or a round of p2p): everything in flight, then waited
            if step.late and mine and self.members(mine[0]).index(self.me) == step.late[0]:
                time.sleep(step.late[1])
            started, held = [], 0
            for item in mine:
                if item.verb == "p2p":
                    started.append((item, *self.start_p2p(item, self._role(item), True)))
                else:
                    started.append((item, *self.start(item, async_op=True)))
                held += buffer_bytes(item, len(self.members(item)))
            self.app_peak = max(self.app_peak, 2 * held)  # the buffers, and the copies kept to check
            for _, work, _, _ in (reversed(started) if step.reverse_wait else started):
                work.wait()
            for item, _, bufs, keep in started:
                self.check(item, bufs, keep)
        return None

    def run_mismatch(self, step, mine):
        """Every call must raise CollectiveMismatch here; success is a wrong result, any other
        error an exception (raised on)."""
        if mine and self.members(mine[0]).index(self.me) == step.late[0]:
            time.sleep(step.late[1])
        for item in mine:
            c, members = self.comms[item.comm], self.members(item)
            x = np.ones(8 if members.index(self.me) == item.odd else 4, np.float32)
            try:
                c.all_reduce(x, algorithm=item.alg)
            except ringcomm.CollectiveMismatch:
                self.mismatches += 1
                self.done[("mismatch", item.alg)] += 1
                continue
            self.n_wrong += 1
            if len(self.wrong) < 10:
                self.wrong.append({"item": describe_item(item, members), "problems": ["a mismatched call succeeded"]})

    def _role(self, item):
        return "send" if self.members(item).index(self.me) == item.src else "recv"

    def _tally_torch(self, item, problems):
        if problems:
            self.n_wrong += 1
            if len(self.wrong) < 10:
                self.wrong.append({"item": f"torch {describe_item(item, None)}", "problems": problems})
        self.done[("torch." + item.verb, "-")] += 1


def describe(got, want):
    if got is None:
        return "None"
    if got.size != want.size or got.dtype != want.dtype:
        return f"{got.dtype}[{got.size}] where {want.dtype}[{want.size}] was expected"
    a, b = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    bad = np.flatnonzero(a != b)
    i = int(bad[0]) // got.itemsize
    return (f"{bad.size} bytes differ, first at element {i} of {got.size}: got {got.reshape(-1)[i]!r}, "
            f"expected {want.reshape(-1)[i]!r}")


def describe_item(item, members):
    """The item's fields that differ from their defaults (id, verb and comm always)."""
    fields = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)
              if f.name in ("id", "verb", "comm") or getattr(item, f.name) != f.default}
    return f"{fields}" + (f" on group {list(members)}" if members else "")


def bound(rank, baseline_kib, torch_slice):
    """README's bound on what a rank holds for its peers, per peer and communicator:
    W × B_max(comm) + P2P_WINDOW × (tags used on comm), summed over every peer of every
    communicator this rank is in (the torch backend's world and group too); plus the
    baseline and the most this process's own buffers held. Bytes."""
    per_comm = []
    for index, comm in enumerate(rank.comms):
        if comm is None:
            continue
        peers = comm.world_size - 1
        per_comm.append(peers * (WINDOW * rank.b_max[index] + P2P_WINDOW * len(rank.tags[index])))
    if torch_slice is not None:
        per_comm += torch_slice.bound_terms(WINDOW, P2P_WINDOW)
    collective = sum(per_comm)
    return {"baseline_bytes": baseline_kib * 1024, "app_peak_bytes": rank.app_peak,
            "held_for_peers_bytes": collective,
            "collective_part_bytes": sum(WINDOW * rank.b_max[i] * (c.world_size - 1)
                                         for i, c in enumerate(rank.comms) if c is not None),
            "bound_bytes": baseline_kib * 1024 + rank.app_peak + collective}


def wait_for_go(sync_dir, rank, timeout=300.0):
    """Say this rank is ready, then wait for the driver's go (it starts the hog first)."""
    with open(os.path.join(sync_dir, f"ready{rank}"), "w"):
        pass
    go, deadline = os.path.join(sync_dir, "go"), time.monotonic() + timeout
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go from the driver within {timeout} s")
        time.sleep(0.01)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--ops", type=int, help="calls in the plan (each counted once, whoever takes part)")
    length.add_argument("--seconds", type=float, help="run until this many seconds have passed on some rank")
    p.add_argument("--max-bytes", type=int, default=1 << 20)
    p.add_argument("--torch-port", type=int, help="run torch.distributed steps; their store's port")
    p.add_argument("--sync-dir", required=True, help="where the ready/go files of the driver live")
    p.add_argument("--report", required=True)
    args = p.parse_args(argv)

    comm = ringcomm.init()
    n, me = comm.world_size, comm.rank
    plan = Plan(args.seed, n, args.max_bytes, torch=args.torch_port is not None)
    rank = Rank(comm, plan, args.seed)
    torch_slice = None
    if args.torch_port is not None:
        from stress_torch import TorchSlice
        torch_slice = TorchSlice(me, n, args.torch_port, comm.timeout, plan.torch_group, args.seed)
    for step in plan.initial_groups():
        rank.make_group(step)
    comm.barrier()
    before = rss_kib()
    baseline = before["ru_maxrss"]  # the peak so far, compared with the peak at the end
    wait_for_go(args.sync_dir, me)
    comm.barrier()
    start = time.monotonic()
    report = {"rank": me, "world_size": n, "seed": args.seed, "exceptions": 0, "exception": None}
    total, steps = 0, plan.steps()
    try:
        index = 0
        while True:
            if args.seconds is not None and index % AGREE_EVERY == AGREE_EVERY - 1:
                flag = rank.run_step(_agree(plan, time.monotonic() - start >= args.seconds), torch_slice)
                if flag:
                    break
            step = next(steps)
            if args.ops is not None:
                if total >= args.ops:
                    break
                total += len(step.items)
            rank.run_step(step, torch_slice)
            index += 1
        comm.barrier()  # every rank finished its plan
    except Exception as exc:  # noqa: BLE001 - reported; after one the ranks disagree on what is next
        report["exceptions"] = 1
        report["exception"] = {"type": type(exc).__name__, "message": str(exc)[:4000],
                               "traceback": traceback.format_exc()[-8000:], "at_step": index}
        print(f"stress rank {me}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    wall = time.monotonic() - start
    after = rss_kib()
    credit = getattr(comm._engine.session, "credit", None)  # how often backpressure held a send
    report.update(
        ops_planned=rank.planned, ops_done=sum(rank.done.values()), wrong=rank.n_wrong, wrong_first=rank.wrong,
        steps=index, wall_s=round(wall, 3), by_verb={f"{v}/{a}": k for (v, a), k in sorted(rank.done.items())},
        groups=[list(g) for g in plan.groups], member_of=[c is not None for c in rank.comms],
        credit_stalls=getattr(credit, "stalls", None), mismatches=rank.mismatches,
        rss_before_kib=before, rss_after_kib=after,
        peak_rss_bytes=after["ru_maxrss"] * 1024, window=WINDOW, p2p_window=P2P_WINDOW,
        b_max_bytes={str(i): b for i, b in sorted(rank.b_max.items())},
        tags_in_use={str(i): sorted(t) for i, t in sorted(rank.tags.items())},
        **bound(rank, baseline, torch_slice))
    if torch_slice is not None:
        report["torch_credit_stalls"] = torch_slice.credit_stalls()
    with open(args.report + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(args.report + ".tmp", args.report)  # the driver never reads half a report
    if report["exceptions"]:
        os._exit(1)  # the job is broken: no goodbyes to wait for
    if torch_slice is not None:
        torch_slice.close()
    comm.close()


def _agree(plan, time_is_up):
    step = plan.agree_step()
    step.time_is_up = int(time_is_up)
    return step


if __name__ == "__main__":
    main()
