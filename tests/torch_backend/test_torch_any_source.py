"""``dist.recv(t)`` and ``dist.irecv(t)`` without ``src``: the first message from any rank,
and the rank it came from (a global rank, also through a group)."""
import json
import textwrap

import pytest

from harness import spawn_job

pytest.importorskip("torch", reason="the torch backend needs PyTorch (make test installs the CPU wheel)")
pytestmark = pytest.mark.timeout(120)

WORKER = textwrap.dedent("""
    import json
    import torch, torch.distributed as dist
    import ringcomm.torch

    dist.init_process_group("ringcomm")
    rank = dist.get_rank()
    late = dist.new_group([0, 2])       # group rank 1 is global rank 2
    report = {}
    if rank == 0:
        got = []
        for _ in range(2):
            t = torch.empty(4, dtype=torch.bfloat16)
            src = dist.recv(t, tag=3)
            got.append([src, t.float().tolist()])
        t = torch.empty(4, dtype=torch.bfloat16)
        work = dist.irecv(t, tag=3)
        work.wait()
        got.append([work._source_rank(), t.float().tolist()])
        report["any"] = got
        dist.barrier()
        t = torch.empty(2)
        report["group"] = [dist.recv(t, group=late), t.tolist()]
    else:
        dist.send(torch.full((4,), rank + 0.5, dtype=torch.bfloat16), 0, tag=3)
        if rank == 1:
            dist.send(torch.full((4,), 7.0, dtype=torch.bfloat16), 0, tag=3)
        dist.barrier()
        if rank == 2:
            dist.send(torch.full((2,), 9.0), group=late, group_dst=0)
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()
""")


def test_recv_without_src_returns_the_sender_and_its_data():
    results = spawn_job(WORKER, 3, timeout=100)
    for code, _out, err in results:
        assert code == 0, err[-3000:]
    report = json.loads(results[0][1].splitlines()[-1])
    got = report["any"]  # rank 1's two messages in the order it sent them, rank 2's anywhere
    assert sorted(got) == [[1, [1.5] * 4], [1, [7.0] * 4], [2, [2.5] * 4]], got
    assert [v for src, v in got if src == 1] == [[1.5] * 4, [7.0] * 4], got
    assert report["group"] == [2, [9.0, 9.0]]
