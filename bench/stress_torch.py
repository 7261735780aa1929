"""The torch.distributed slice of the stress job: verbs through the "ringcomm" backend, in the
same process as bench/stress_worker.py's own ringcomm world.

The backend makes a ringcomm world of its own (``ringcomm.init`` again, at a port agreed
through torch's store), so a rank holds two independent worlds, each with its communication
thread; the plan's steps alternate between them. The store is a TCPStore at
``--torch-port`` (``init_method="tcp://..."``), not ``MASTER_PORT``, which the first world's
rendezvous already took. Results are checked against numpy, from the plan's inputs.

>>> ts = TorchSlice(rank, n, port, timeout, members=(0, 1, 2), seed=7)
>>> problems = ts.run(item)      # [] when the verb's results are right
"""
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import ringcomm.torch  # noqa: F401 - registers the backend "ringcomm"
from stress_plan import P2P_TAGS, data, reduce_all, same_bits

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "prod": dist.ReduceOp.PRODUCT,
       "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "band": dist.ReduceOp.BAND,
       "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
REDUCING = ("all_reduce", "all_reduce_async", "reduce", "reduce_scatter_tensor")


class TorchSlice:
    def __init__(self, rank, n, port, timeout, members, seed):
        self.rank, self.n, self.seed, self.members = rank, n, seed, tuple(members)
        dist.init_process_group("ringcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=timedelta(seconds=timeout))
        self.group = dist.new_group(list(self.members))  # every rank calls it; members get a group
        self.b_max = {0: 0, -1: 0}

    def takes_part(self, item):
        members = self.members if item.comm == -1 else tuple(range(self.n))
        if self.rank not in members:
            return False
        if item.verb in ("send_recv", "batch_isend_irecv"):
            return members.index(self.rank) in (item.src, item.dst)
        return True

    def run(self, item):
        """Run ``item`` on this rank; the list of wrong results (empty: all right)."""
        members = self.members if item.comm == -1 else tuple(range(self.n))
        group = self.group if item.comm == -1 else None
        g, r, v = len(members), members.index(self.rank), item.verb
        kind = "reduce" if v in REDUCING else "move"
        dt = np.dtype(item.dtype)
        self.b_max[item.comm] = max(self.b_max[item.comm], 2 * g * max(item.m, 1) * dt.itemsize)

        def inp(s, count=item.m):
            return data(self.seed, item, s, count, kind)

        def t(a):
            return torch.from_numpy(a.copy())

        def garbage(count):
            return torch.from_numpy(data(self.seed, item, r, count, "garbage"))
        root, op, m = members[item.root], OPS.get(item.op), item.m
        got, want = [], []
        if v in ("all_reduce", "all_reduce_async"):
            x = t(inp(r))
            work = dist.all_reduce(x, op=op, group=group, async_op=v.endswith("async"))
            if work is not None:
                work.wait()
            got, want = [x], [reduce_all(item.op, [inp(s) for s in range(g)])]
        elif v == "broadcast":
            x = t(inp(r)) if r == item.root else garbage(m)
            dist.broadcast(x, src=root, group=group)
            got, want = [x], [inp(item.root)]
        elif v == "reduce":
            x = t(inp(r))
            dist.reduce(x, dst=root, op=op, group=group)
            if r == item.root:  # elsewhere torch leaves the tensor's contents unspecified
                got, want = [x], [reduce_all(item.op, [inp(s) for s in range(g)])]
        elif v == "all_gather_into_tensor":
            out = garbage(g * m)
            dist.all_gather_into_tensor(out, t(inp(r)), group=group)
            got, want = [out], [np.concatenate([inp(s) for s in range(g)])]
        elif v == "all_gather":
            outs = [garbage(m) for _ in range(g)]
            dist.all_gather(outs, t(inp(r)), group=group)
            got, want = outs, [inp(s) for s in range(g)]
        elif v == "reduce_scatter_tensor":
            out = garbage(m)
            dist.reduce_scatter_tensor(out, t(inp(r, g * m)), op=op, group=group)
            got, want = [out], [reduce_all(item.op, [inp(s, g * m) for s in range(g)])[r * m:(r + 1) * m]]
        elif v == "all_to_all_single":
            splits = item.splits
            x = t(inp(r, sum(splits[r])))
            out = garbage(sum(splits[s][r] for s in range(g)))
            dist.all_to_all_single(out, x, output_split_sizes=[splits[s][r] for s in range(g)],
                                   input_split_sizes=list(splits[r]), group=group)
            blocks = [inp(s, sum(splits[s]))[sum(splits[s][:r]):sum(splits[s][:r + 1])] for s in range(g)]
            got, want = [out], [np.concatenate(blocks)]
        elif v == "gather":
            outs = [garbage(m) for _ in range(g)] if r == item.root else None
            dist.gather(t(inp(r)), outs, dst=root, group=group)
            if outs is not None:
                got, want = outs, [inp(s) for s in range(g)]
        elif v == "scatter":
            out = garbage(m)
            pieces = [t(inp(item.root, g * m)[s * m:(s + 1) * m]) for s in range(g)] if r == item.root else None
            dist.scatter(out, pieces, src=root, group=group)
            got, want = [out], [inp(item.root, g * m)[r * m:(r + 1) * m]]
        elif v == "barrier":
            dist.barrier(group=group)
        elif v == "send_recv":
            if r == item.src:
                dist.send(t(inp(item.src)), dst=members[item.dst], group=group, tag=item.tag)
            else:
                out = garbage(m)
                dist.recv(out, src=members[item.src], group=group, tag=item.tag)
                got, want = [out], [inp(item.src)]
        elif v == "batch_isend_irecv":  # both ways at once
            peer = item.dst if r == item.src else item.src
            out = garbage(m)
            ops = [dist.P2POp(dist.isend, t(inp(r)), members[peer], group=group, tag=item.tag),
                   dist.P2POp(dist.irecv, out, members[peer], group=group, tag=item.tag)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            got, want = [out], [inp(peer)]
        else:
            raise AssertionError(f"not a torch verb: {v}")
        return [f"tensor {i}: differs from numpy ({a.dtype}[{a.numel()}])"
                for i, (a, b) in enumerate(zip(got, want, strict=True)) if not same_bits(a.numpy(), b)]

    def bound_terms(self, window, p2p_window):
        """README's per-peer terms for this world's communicators (bytes, summed over peers)."""
        terms = []
        for comm, size in ((0, self.n), (-1, len(self.members))):
            if comm == -1 and self.rank not in self.members:
                continue
            terms.append((size - 1) * (window * self.b_max[comm] + p2p_window * len(P2P_TAGS)))
        return terms

    def credit_stalls(self):
        from ringcomm.torch import backend
        world = backend._world
        credit = getattr(world._engine.session, "credit", None) if world is not None else None
        return getattr(credit, "stalls", None)

    def close(self):
        dist.destroy_process_group()
