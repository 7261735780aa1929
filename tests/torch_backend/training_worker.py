"""PyTorch's own data-parallel trainers on the "ringcomm" backend against the same training
on Gloo: DDP (default buckets; tiny buckets with gradient_as_bucket_view; no_sync
accumulation; the fp16 compression hook; Join with uneven inputs; PowerSGD),
ZeroRedundancyOptimizer and FSDP2's fully_shard.

Run under a launcher (``python -m ringcomm.launch --nproc N training_worker.py OUT_DIR
[VARIANT ...]``; ``crossed_hooks`` is the one variant not run by default). Each variant trains one seeded model twice in the same processes, once
over ringcomm (the default group) and once over a Gloo group of the same ranks, and writes
per rank ``OUT_DIR/rank{r}.json``: {variant: {"relative": max relative parameter difference
ringcomm vs Gloo, "identical": whether every rank's ringcomm parameters are the same bits,
"loss": the last loss}}.
"""
import contextlib
import json
import os
import sys
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm.torch  # noqa: F401 - registers the backend

STEPS = 6


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def batches(count):
    g = torch.Generator().manual_seed(zlib.crc32(f"batch/{dist.get_rank()}".encode()))
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(count)]


def loss_of(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


def train(net, opt, data):
    """Steps over ``data``; the last loss."""
    for x, y in data:
        loss = loss_of(net, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss


def ddp(group, hook=None, accumulate=False, uneven=False, **kw):
    net = DDP(model(), process_group=group, **kw)
    if hook == "fp16":
        net.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                            min_compression_rate=0.5, random_seed=0)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = batches(STEPS + (dist.get_rank() if uneven else 0))
    loss = None
    with Join([net]) if uneven else contextlib.nullcontext():
        for i, (x, y) in enumerate(data):
            if accumulate and i % 2 == 0:
                with net.no_sync():
                    loss_of(net, x, y).backward()
                continue
            loss = loss_of(net, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return list(net.module.parameters()), loss


def zero(group):
    net = DDP(model(), process_group=group)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, process_group=group,
                                  lr=0.01)
    return list(net.module.parameters()), train(net, opt, batches(STEPS))


def fsdp2(group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group, "cpu")
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    loss = train(net, torch.optim.Adam(net.parameters(), lr=0.01), batches(STEPS))
    return [p.full_tensor() for p in net.parameters()], loss


def crossed_hooks(group):
    """A comm hook that issues its two all-reduces in one order on rank 0 and the other order
    elsewhere: the error every rank gets (Gloo would hang)."""
    def hook(process_group, bucket):
        extra = torch.ones(1)
        pair = [bucket.buffer(), extra] if dist.get_rank() == 0 else [extra, bucket.buffer()]
        futures = [dist.all_reduce(t, group=process_group, async_op=True).get_future() for t in pair]

        def done(both):
            # collect_all fails as soon as one of its futures does (the other may still
            # run): its own value raises that first error
            both.value()
            return bucket.buffer()
        return torch.futures.collect_all(futures).then(done)
    net = DDP(model(), process_group=group)
    net.register_comm_hook(group, hook)
    x, y = batches(1)[0]
    try:
        loss_of(net, x, y).backward()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - the point of the variant
        return f"{type(exc).__name__}: {exc}"


VARIANTS = {
    "ddp": lambda g: ddp(g),
    "ddp_tiny_buckets_views": lambda g: ddp(g, bucket_cap_mb=0.002, gradient_as_bucket_view=True),
    "ddp_no_sync": lambda g: ddp(g, accumulate=True),
    "ddp_fp16_hook": lambda g: ddp(g, hook="fp16"),
    "ddp_join_uneven": lambda g: ddp(g, uneven=True),
    "ddp_powersgd": lambda g: ddp(g, hook="powersgd"),
    "zero_redundancy": zero,
    "fsdp2": fsdp2,
}


def compare(name, gloo):
    ours, loss = VARIANTS[name](dist.group.WORLD)
    theirs, _ = VARIANTS[name](gloo)
    relative = max(float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))
                   for a, b in zip(ours, theirs, strict=True))
    flat = torch.cat([p.detach().reshape(-1) for p in ours])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat, group=gloo)
    identical = all(torch.equal(e.view(torch.int32), flat.view(torch.int32)) for e in everyone)
    return {"relative": relative, "identical": identical, "loss": loss.item()}


if __name__ == "__main__":
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    report = {}
    if "crossed_hooks" in sys.argv[2:]:
        report["crossed_hooks"] = crossed_hooks(dist.group.WORLD)
    for name in [v for v in sys.argv[2:] if v in VARIANTS] if sys.argv[2:] else VARIANTS:
        try:
            report[name] = compare(name, gloo)
        except Exception as exc:  # noqa: BLE001 - reported; ranks stay in step or time out
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
