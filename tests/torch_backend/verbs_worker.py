"""Every torch.distributed verb on the "ringcomm" backend against Gloo on the same inputs.

Run under a launcher (``python -m ringcomm.launch --nproc N verbs_worker.py OUT_DIR``): the
default group is ringcomm, a Gloo group over the same ranks is the oracle. Every rank writes
``OUT_DIR/rank{r}.json``: a list of [case, problem or null]. Inputs are seeded by (case,
rank), so both backends see the same tensors.
"""
import json
import os
import sys
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm.torch  # noqa: F401 - registers the backend
from ringcomm import CollectiveMismatch

R = dist.ReduceOp
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-6, torch.float64: 1e-12,
             torch.complex64: 1e-6, torch.complex128: 1e-12}
REPORT = []


def data(case, rank, shape, dtype):
    """Seeded per (case, rank): both backends get the same values."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        real = torch.rand(shape, generator=g, dtype=torch.float64) * 2 + 0.5
        if dtype.is_complex:
            return torch.complex(real, torch.rand(shape, generator=g, dtype=torch.float64)).to(dtype)
        return real.to(dtype)
    high = 4 if dtype in (torch.int8, torch.uint8) else 1000
    return torch.randint(1, high, shape, generator=g).to(dtype)


def same(a, b, exact):
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if exact or a.dtype not in TOLERANCE:
        return None if torch.equal(a, b) else f"differs: {a.flatten()[:6].tolist()} vs {b.flatten()[:6].tolist()}"
    tol = TOLERANCE[a.dtype]
    ok = torch.allclose(a.to(torch.complex128 if a.is_complex() else torch.float64),
                        b.to(torch.complex128 if b.is_complex() else torch.float64), rtol=tol, atol=tol)
    return None if ok else f"not within {tol}: {a.flatten()[:6].tolist()} vs {b.flatten()[:6].tolist()}"


def check(case, run, exact=True):
    """``run(group)`` -> list of output tensors, on ringcomm and on Gloo; compared."""
    try:
        ours, theirs = run(dist.group.WORLD), run(GLOO)
        problems = [p for a, b in zip(ours, theirs, strict=True) if (p := same(a, b, exact))]
        REPORT.append([case, "; ".join(problems) or None])
    except Exception as exc:  # noqa: BLE001 - reported, the next case goes on
        REPORT.append([case, f"{type(exc).__name__}: {exc}"])
        print(f"rank {RANK}: {case}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def identical_across_ranks(case, tensor):
    """Every ringcomm rank holds the same bits (gathered through Gloo)."""
    raw = tensor.contiguous().view(torch.uint8).flatten() if tensor.dtype != torch.bool else tensor.to(torch.uint8)
    everyone = [torch.empty_like(raw) for _ in range(N)]
    dist.all_gather(everyone, raw, group=GLOO)
    REPORT.append([case + " bitwise on every rank",
                   None if all(torch.equal(e, everyone[0]) for e in everyone) else "ranks differ"])


def gloo_lacks_list_all_to_all():
    """Older torch's Gloo (2.11) refuses the list all_to_all, on every rank alike, before
    anything is sent: then the oracle sends the same blocks as one tensor."""
    try:
        dist.all_to_all([torch.empty(1) for _ in range(N)], [torch.zeros(1) for _ in range(N)], group=GLOO)
        return False
    except RuntimeError as exc:
        if "does not support alltoall" not in str(exc):
            raise
        return True


def reductions():
    ops = {t: [R.SUM, R.PRODUCT, R.MIN, R.MAX] + ([R.AVG] if t in FLOATS else [R.BAND, R.BOR, R.BXOR])
           for t in FLOATS + INTS}
    for dtype, names in ops.items():
        for op in names:
            case = f"all_reduce {dtype} {op}"
            x = data(case, RANK, (37,), dtype)
            kept = {}

            def run(group, x=x, op=op, kept=kept):
                t = x.clone()
                dist.all_reduce(t, op=op, group=group)
                kept.setdefault("ours", t)
                return [t]
            check(case, run, exact=not (dtype.is_floating_point and N > 2))
            identical_across_ranks(case, kept["ours"])
    case = "all_reduce complex64 sum, avg"
    z = data(case, RANK, (9,), torch.complex64)
    check(case, lambda g: [_reduced(z, R.SUM, g), _reduced(z, R.AVG, g)], exact=N == 2)
    case = "all_reduce premul_sum"
    x = data(case, RANK, (11,), torch.float64)
    ours = _reduced(x, dist._make_nccl_premul_sum(0.25), dist.group.WORLD)
    REPORT.append([case, same(ours, _reduced(x * 0.25, R.SUM, GLOO), exact=False)])
    case = "all_reduce non-contiguous"
    m = data(case, RANK, (6, 8), torch.float32)
    check(case, lambda g: [_reduced(m.t(), R.SUM, g)], exact=N == 2)
    case = "all_reduce_coalesced"
    a, b = data(case, RANK, (5,), torch.float64), data(case + "b", RANK, (3, 2), torch.float64)
    check(case, lambda g: _coalesced([a, b], g), exact=N == 2)
    for op in (R.SUM, R.MAX):
        case = f"reduce_scatter list/tensor {op}"
        pieces = [data(case, RANK * N + i, (4,), torch.float32) for i in range(N)]
        check(case, lambda g, pieces=pieces, op=op: _reduce_scatters(pieces, op, g), exact=N == 2 or op == R.MAX)
    case = "reduce"
    x = data(case, RANK, (13,), torch.float64)
    root = 1 % N
    check(case, lambda g: [_reduced(x, R.SUM, g, root)][:1 if root == RANK else 0], exact=N == 2)


def beyond_gloo():
    """dtypes Gloo refuses ("Invalid scalar type"), and complex128: checked against every
    rank's seeded input, stacked and reduced here."""
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex128):
        for op in (R.SUM,) if dtype.is_complex else (R.SUM, R.MAX, R.BXOR):
            case = f"all_reduce {dtype} {op} against the stacked inputs"
            inputs = [data(case, r, (9,), dtype) for r in range(N)]
            got = _reduced(inputs[RANK], op, dist.group.WORLD)
            wide = [t.to(torch.complex128 if dtype.is_complex else torch.int64) for t in inputs]
            if op == R.SUM:
                expected = sum(wide)
            elif op == R.MAX:
                expected = torch.stack(wide).amax(0)
            else:
                expected = wide[0]
                for t in wide[1:]:
                    expected = expected ^ t
            REPORT.append([case, same(got, expected.to(dtype), exact=not dtype.is_complex or N == 2)])


def _reduced(x, op, group, root=None):
    t = x.clone()
    if root is None:
        dist.all_reduce(t, op=op, group=group)
    else:
        dist.reduce(t, dst=_global(root, group), op=op, group=group)
    return t


def _global(group_rank, group):
    return dist.get_global_rank(group, group_rank) if group is not dist.group.WORLD else group_rank


def _coalesced(tensors, group):
    ts = [t.clone() for t in tensors]
    dist.all_reduce_coalesced(ts, group=group)
    return ts


def _reduce_scatters(pieces, op, group):
    one, two = torch.empty(4), torch.empty(4)
    dist.reduce_scatter(one, [p.clone() for p in pieces], op=op, group=group)
    dist.reduce_scatter_tensor(two, torch.cat(pieces), op=op, group=group)
    return [one, two]


def movements():
    for dtype in (torch.bfloat16, torch.int64, torch.bool, torch.complex64, torch.float16):
        case = f"all_gather list/tensor, broadcast {dtype}"
        x = data(case, RANK, (5,), dtype)

        def run(group, x=x):
            pieces = [torch.empty_like(x) for _ in range(N)]
            dist.all_gather(pieces, x, group=group)
            whole = torch.empty(N * 5, dtype=x.dtype)
            dist.all_gather_into_tensor(whole, x, group=group)
            y = x.clone()
            dist.broadcast(y, src=_global(N - 1, group), group=group)
            return [*pieces, whole, y]
        check(case, run)
    case = "all_gather_coalesced, inputs of two sizes"
    xs = [data(case, RANK, (3,), torch.float32), data(case + "b", RANK, (2, 2), torch.float32)]

    def coalesced_gather(group):
        outs = [[torch.empty_like(x) for x in xs] for _ in range(N)]  # outs[rank][input]
        dist.all_gather_coalesced(outs, xs, group=group)
        return [t for per_rank in outs for t in per_rank]
    check(case, coalesced_gather)
    case = "gather, scatter"
    x = data(case, RANK, (6,), torch.int32)
    sources = [data(case, 100 + i, (6,), torch.int32) for i in range(N)]

    def gather_scatter(group):
        got = [torch.empty_like(x) for _ in range(N)] if RANK == 0 else None
        dist.gather(x, got, dst=_global(0, group), group=group)
        out = torch.empty_like(x)
        dist.scatter(out, sources if RANK == N - 1 else None, src=_global(N - 1, group), group=group)
        return (got or []) + [out]
    check(case, gather_scatter)
    case = "all_to_all list (uneven), single (even and uneven)"
    sizes = [[(r + s) % 3 + 1 for s in range(N)] for r in range(N)]  # rank r sends sizes[r][s] to s
    ins = [data(case, RANK * N + s, (sizes[RANK][s],), torch.float32) for s in range(N)]

    # Gloo's list all_to_all takes equal sizes only: the uneven one is checked against what
    # the senders' seeds say it must be
    outs = [torch.empty(sizes[s][RANK]) for s in range(N)]
    dist.all_to_all(outs, [t.clone() for t in ins])
    expected = [data(case, s * N + RANK, (sizes[s][RANK],), torch.float32) for s in range(N)]
    REPORT.append([case + ": list", "; ".join(p for a, b in zip(outs, expected, strict=True) if (p := same(a, b, True)))
                   or None])

    def all_to_all(group):
        outs = [torch.empty(2) for s in range(N)]
        blocks = [t[:1].repeat(2) for t in ins]
        if group is GLOO and GLOO_LACKS_LIST_ALL_TO_ALL:  # torch 2.11's Gloo: the same blocks as one
            whole = torch.empty(2 * N)
            dist.all_to_all_single(whole, torch.cat(blocks), group=group)
            outs = list(whole.split(2))
        else:
            dist.all_to_all(outs, blocks, group=group)
        even_in = data(case, RANK, (N * 2, 3), torch.float64)
        even_out = torch.empty_like(even_in)
        dist.all_to_all_single(even_out, even_in, group=group)
        rows_in = [sizes[RANK][s] for s in range(N)]
        rows_out = [sizes[s][RANK] for s in range(N)]
        uneven_in = data(case + "u", RANK, (sum(rows_in), 2), torch.int64)
        uneven_out = torch.empty(sum(rows_out), 2, dtype=torch.int64)
        dist.all_to_all_single(uneven_out, uneven_in, rows_out, rows_in, group=group)
        return [*outs, even_out, uneven_out]
    check(case, all_to_all)


def point_to_point():
    case = "send/recv ring, isend/irecv, batch_isend_irecv"
    x = data(case, RANK, (7,), torch.float32)

    def ring(group):
        right, left = _global((RANK + 1) % N, group), _global((RANK - 1) % N, group)
        got = torch.empty_like(x)
        if RANK % 2 == 0:
            dist.send(x, right, group=group)
            dist.recv(got, left, group=group)
        else:
            dist.recv(got, left, group=group)
            dist.send(x, right, group=group)
        a, b = torch.empty_like(x), torch.empty_like(x)
        for w in [dist.isend(x * 2, right, group=group), dist.irecv(a, left, group=group)]:
            w.wait()
        ops = [dist.P2POp(dist.isend, x * 3, right, group=group), dist.P2POp(dist.irecv, b, left, group=group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return [got, a, b]
    check(case, ring)
    dist.barrier()
    REPORT.append(["barrier", None])
    pg = dist.distributed_c10d._get_default_group()
    try:
        pg.monitored_barrier(timedelta(seconds=30), True)
        REPORT.append(["monitored_barrier", None])
    except Exception as exc:  # noqa: BLE001
        REPORT.append(["monitored_barrier", f"{type(exc).__name__}: {exc}"])


def work_and_errors():
    case = "async work, future value"
    x = torch.full((4,), float(RANK + 1))
    work = dist.all_reduce(x, async_op=True)
    value = work.get_future().then(lambda f: f.value()[0] * 2).wait()
    work.wait()
    total = float(sum(range(1, N + 1)))
    REPORT.append([case, None if x.tolist() == [total] * 4 and value.tolist() == [2 * total] * 4
                   else f"{x.tolist()} {value.tolist()}"])
    case = "a collective started and waited for inside a future's callback"
    y = torch.ones(3)

    def nested(_):
        dist.all_reduce(y, async_op=True).get_future().wait()
        return y.sum()
    total = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(nested).wait()
    REPORT.append([case, None if total.item() == 3.0 * N else str(total)])
    case = "a group its members alone create"
    if RANK < 2:
        pair = dist.new_group([0, 1], use_local_synchronization=True)
        z = torch.full((2,), float(RANK + 1))
        dist.all_reduce(z, group=pair)
        REPORT.append([case, None if z.tolist() == [3.0, 3.0] else str(z.tolist())])
    case = "is_completed() only once copied outputs hold their data"
    pieces = [torch.zeros(3, dtype=torch.bfloat16) for _ in range(N)]
    work = dist.all_gather(pieces, torch.full((3,), float(RANK + 1), dtype=torch.bfloat16), async_op=True)
    while not work.is_completed():
        pass
    REPORT.append([case, None if [p[0].item() for p in pieces] == [r + 1.0 for r in range(N)] else str(pieces)])
    case = "all_reduce of a bfloat16 leaf that requires grad"

    def leaf(group):
        a = torch.full((4,), float(RANK + 1), dtype=torch.bfloat16, requires_grad=True)
        dist.all_reduce(a, group=group)
        return [a.detach()]
    check(case, leaf)
    # Gloo writes a strided view's numel elements as if it were contiguous (the other columns
    # get them): the expected values are written out here instead
    case = "all_reduce of a column of a leaf that requires grad"
    b = torch.full((3, 4), float(RANK + 1), requires_grad=True)
    dist.all_reduce(b[:, 1])
    expected = torch.full((3, 4), float(RANK + 1))
    expected[:, 1] = float(sum(range(1, N + 1)))
    REPORT.append([case, same(b.detach(), expected, True)])
    case = "reduce with PREMUL_SUM leaves other ranks' tensors alone"
    x = torch.full((5,), float(RANK + 1), dtype=torch.float64)
    dist.reduce(x, dst=0, op=dist._make_nccl_premul_sum(0.5))
    expected = 0.5 * sum(range(1, N + 1)) if RANK == 0 else float(RANK + 1)
    REPORT.append([case, None if x.tolist() == [expected] * 5 else str(x.tolist())])
    case = "mismatched sizes raise CollectiveMismatch from wait()"
    work = dist.all_reduce(torch.ones(3 + RANK), async_op=True)
    try:
        work.wait()
        REPORT.append([case, "no error"])
    except CollectiveMismatch as exc:
        REPORT.append([case, None if "all_reduce" in str(exc) else str(exc)])
    # dtypes that differ only in what the wire elements stand for
    for case, verb, mine, others in [
            ("bfloat16 broadcast against int16 raises CollectiveMismatch", dist.broadcast,
             lambda: torch.ones(4, dtype=torch.bfloat16), lambda: torch.ones(4, dtype=torch.int16)),
            # reduce hands complex tensors to the backend as they are (all_reduce does not)
            ("complex64[2] reduce against float32[4] raises CollectiveMismatch", dist.reduce,
             lambda: torch.ones(2, dtype=torch.complex64), lambda: torch.ones(4)),
            ("bfloat16 all_reduce against float32 raises CollectiveMismatch", dist.all_reduce,
             lambda: torch.ones(4, dtype=torch.bfloat16), lambda: torch.ones(4))]:
        t = mine() if RANK == 0 else others()
        try:
            (verb(t, 0, async_op=True) if verb in (dist.broadcast, dist.reduce) else verb(t, async_op=True)).wait()
            REPORT.append([case, "no error"])
        except CollectiveMismatch as exc:
            REPORT.append([case, None if "bfloat16 as" in str(exc) or "complex as" in str(exc) else str(exc)])
    case = "the group works after a mismatch"
    y = torch.ones(2)
    dist.all_reduce(y)
    REPORT.append([case, None if y.tolist() == [float(N)] * 2 else str(y.tolist())])


def monitored_barrier_names_the_missing_rank():
    """The last case: rank N−1 stays away; rank 0 names it, the others are not released."""
    case = "monitored_barrier names the rank that did not come"
    if RANK == N - 1:
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)  # torch's function
        REPORT.append([case, "no error"])
    except RuntimeError as exc:
        # Gloo's words, which PyTorch's own tests search for
        expected = f"Rank {N - 1} failed to pass monitoredBarrier" if RANK == 0 else \
            f"Rank {RANK} successfully reached monitoredBarrier, but received errors while waiting for " \
            f"send/recv from rank 0 of world: rank {N - 1} failed to pass monitoredBarrier"
        REPORT.append([case, None if expected in str(exc) else str(exc)])


if __name__ == "__main__":
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    RANK, N = dist.get_rank(), dist.get_world_size()
    GLOO = dist.new_group(backend="gloo")
    GLOO_LACKS_LIST_ALL_TO_ALL = gloo_lacks_list_all_to_all()
    reductions()
    beyond_gloo()
    movements()
    point_to_point()
    work_and_errors()
    monitored_barrier_names_the_missing_rank()
    with open(os.path.join(sys.argv[1], f"rank{RANK}.json"), "w") as f:
        json.dump(REPORT, f)
    dist.destroy_process_group()
