"""A rank lost or late inside DDP's backward: every survivor's ``loss.backward()`` raises
ringcomm's error naming that rank, in time, with or without a comm hook; none crashes.

Without a hook DDP's C++ reducer reads each bucket's future itself; with one (a Python hook,
or the fp16 hook's ``then`` chain) Python does. Rank 1 either dies (``os._exit``) or sleeps
past the group's timeout inside the hook of its first layer's gradient, when DDP has already
started the all-reduce of later buckets. The ranks are started torchrun-style (no launcher
that could stop the survivors before they report).
"""
import re
import textwrap

import pytest

from harness import spawn_job

pytest.importorskip("torch", reason="the torch backend needs PyTorch (make test installs the CPU wheel)")
pytestmark = pytest.mark.timeout(120)

TIMEOUT = {"die": 8.0, "late": 3.0}  # the group's timeout: a death must be named well before it

WORKER = textwrap.dedent("""
    import os, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ringcomm.torch

    fault, hook, timeout = os.environ["TEST_FAULT"], os.environ["TEST_HOOK"], float(os.environ["TEST_GROUP_TIMEOUT"])
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)]
    net = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=0.004)
    if hook != "none":
        net.register_comm_hook(None, {"allreduce": default_hooks.allreduce_hook,
                                      "fp16": default_hooks.fp16_compress_hook}[hook])
    x = torch.randn(8, 16)
    net(x).sum().backward()  # one good step

    def fail(grad):
        if fault == "die":
            os._exit(3)
        time.sleep(timeout + 3)
        return grad

    if rank == 1:
        layers[0].weight.register_hook(fail)
    start = time.monotonic()
    try:
        net(x).sum().backward()
        print("no error", flush=True)
    except Exception as exc:
        words = " ".join(str(exc).split("At:")[0].split())
        print(f"raised {type(exc).__name__} after={time.monotonic() - start:.2f} {words}", flush=True)
    os._exit(0)
""")

CASES = [(2, "none", "die"), (2, "none", "late"), (2, "allreduce", "die"), (2, "fp16", "late"),
         (3, "none", "die"), (3, "allreduce", "late")]


@pytest.mark.parametrize("n,hook,fault", CASES)
def test_survivors_raise_naming_the_rank(n, hook, fault):
    timeout = TIMEOUT[fault]
    env = {"TEST_FAULT": fault, "TEST_HOOK": hook, "TEST_GROUP_TIMEOUT": str(timeout)}
    results = spawn_job(WORKER, n, env=env, timeout=90)
    for rank, (code, out, err) in enumerate(results):
        if rank == 1:
            assert code == (3 if fault == "die" else 0), (code, err[-2000:])
            continue
        assert code == 0, f"rank {rank} ended with {code}:\n{err[-3000:]}"
        found = re.search(r"raised RuntimeError after=([\d.]+) (.*)", out)
        assert found, f"rank {rank}: {out!r} {err[-2000:]}"
        seconds = float(found[1])
        # each ``then`` of the chain puts torch's words before ringcomm's error: keep ringcomm's
        words = re.sub(r"^(RuntimeError: )+", "", found[2].split("running the callback: ")[-1])
        kind = words.split(":")[0]
        assert re.search(r"(lost|waiting for) rank 1\b|rank 1 (is alive but never|stopped)", words), \
            f"rank {rank} blames another: {words}"
        if fault == "die":  # named by the liveness check, long before the deadline
            assert kind == "PeerLost" and seconds < timeout - 2, (rank, seconds, words)
        else:
            assert kind == "CommTimeout" and timeout - 0.5 < seconds < timeout + 4, (rank, seconds, words)
