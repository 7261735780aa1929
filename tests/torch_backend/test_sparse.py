"""``dist.all_reduce`` of sparse COO tensors: the sum of every rank's entries (against the
dense sum of the same tensors built on one rank), shapes or dtypes that differ refused on
every rank, and DDP training an ``nn.Embedding(sparse=True)`` as one process would."""
import json
import textwrap

import pytest

from harness import job_outputs

pytest.importorskip("torch", reason="the torch backend needs PyTorch (make test installs the CPU wheel)")
pytestmark = pytest.mark.timeout(150)

WORKER = textwrap.dedent("""
    import json
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    import ringcomm.torch
    from ringcomm.errors import CollectiveMismatch

    dist.init_process_group("ringcomm")
    rank, n = dist.get_rank(), dist.get_world_size()

    def tensor_of(case, r, shape, sparse_dim, dtype):
        g = torch.Generator().manual_seed(100 * case + r)
        nnz = 0 if r == 1 and case % 2 else int(torch.randint(1, 9, (), generator=g))
        index = torch.stack([torch.randint(0, s, (nnz,), generator=g) for s in shape[:sparse_dim]])
        values = torch.randint(-8, 8, (nnz, *shape[sparse_dim:]), generator=g).to(dtype) / 4
        return torch.sparse_coo_tensor(index, values, shape, dtype=dtype)  # duplicates left in

    cases = [((10,), 1, torch.float64), ((5, 6), 2, torch.float32), ((7, 3), 1, torch.int64),
             ((9, 2, 2), 1, torch.bfloat16), ((12,), 1, torch.float32)]
    report = {"cases": []}
    for case, (shape, sparse_dim, dtype) in enumerate(cases):
        t = tensor_of(case, rank, shape, sparse_dim, dtype)
        if case == 4:  # async, through the future as DDP reads it
            work = dist.all_reduce(t, async_op=True)
            t = work.get_future().wait()[0]
        else:
            dist.all_reduce(t)
        want = sum(tensor_of(case, r, shape, sparse_dim, dtype).to_dense().double() for r in range(n))
        report["cases"].append([t.is_sparse, t.is_coalesced(), t._nnz(),
                                (t.to_dense().double() - want).abs().max().item()])

    empty = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0), (4,))
    dist.all_reduce(empty)
    report["empty"] = [empty._nnz(), empty.shape[0]]

    odd = torch.sparse_coo_tensor([[0]], [1.0], (11 if rank == 2 else 10,))
    try:
        dist.all_reduce(odd)
    except CollectiveMismatch as exc:
        report["mismatch"] = str(exc)
    kind = torch.uint16 if rank == 0 else torch.int16  # rank 0 alone holds what it cannot reduce
    try:
        dist.all_reduce(torch.sparse_coo_tensor([[0]], [1], (4,), dtype=kind))
    except ValueError as exc:
        report["odd dtype"] = str(exc)
    try:
        dist.all_reduce(odd, dist.ReduceOp.MAX)
    except ValueError as exc:
        report["max"] = str(exc)
    dense = torch.ones(3)
    dist.all_reduce(dense)  # the group still works
    report["after"] = dense.tolist()

    # DDP over an embedding with sparse gradients, against one process on every rank's batch
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 1))
    def batch(step, r):
        g = torch.Generator().manual_seed(10 * step + r)
        return torch.randint(0, 20, (6,), generator=g), torch.randn(6, 1, generator=g)
    ddp, alone = torch.nn.parallel.DistributedDataParallel(model()), model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ddp, alone)]
    for step in range(3):
        x, y = batch(step, rank)
        F.mse_loss(ddp(x), y).backward()
        xs, ys = zip(*(batch(step, r) for r in range(n)))
        F.mse_loss(alone(torch.cat(xs)), torch.cat(ys)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    report["ddp"] = max((a - b).abs().max().item()
                        for a, b in zip(ddp.module.parameters(), alone.parameters()))
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()
""")


def test_sparse_all_reduce_sums_every_ranks_entries():
    reports = [json.loads(out.splitlines()[-1]) for out in job_outputs(WORKER, 3, timeout=130)]
    for report in reports:
        for is_sparse, coalesced, nnz, error in report["cases"]:
            assert is_sparse and coalesced and nnz > 0, report["cases"]
            assert error == 0, report["cases"]  # quarters of small integers add exactly
        assert report["empty"] == [0, 4]
        assert "rank(s) [0, 1]: torch.float32 of shape (10,)" in report["mismatch"], report
        assert "rank(s) [2]: torch.float32 of shape (11,)" in report["mismatch"], report
        assert "rank(s) [0] hold sparse tensors it cannot reduce" in report["odd dtype"], report
        assert "SUM only" in report["max"], report
        assert report["after"] == [3.0, 3.0, 3.0]
        assert report["ddp"] < 1e-6, report["ddp"]
    assert len({json.dumps(r["cases"]) for r in reports}) == 1  # one result on every rank
