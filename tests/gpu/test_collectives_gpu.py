"""Collectives on CuPy arrays and the trainer with --device gpu, on real processes, run on
two backends:

- ``cuda``: the real CuPy on a GPU (skipped, saying why, where there is none);
- ``standin``: the strict CuPy stand-in of ``tests/standin`` on the CPU, which defers work
  on streams until something waits for it, refuses numpy/device mixing, gives each rank of
  a host its own device, and so fails where a missing stream wait, a missing device switch
  or a host/device mix would make a GPU wrong. It runs in ``make test``.

Processes are started fresh (never forked from this one), with the backend's ``cupy``.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness import job_outputs

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "standin"


@pytest.fixture(params=["standin", "cuda"])
def backend(request):
    """(name, environment for the ranks) of one CuPy backend; conftest skips ``cuda`` where
    there is no GPU."""
    if request.param == "cuda":
        return "cuda", {}
    path = os.pathsep.join([str(STANDIN), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return "standin", {"PYTHONPATH": path, "CUPY_STANDIN_DEVICES": "4"}


def reported(out, tag):
    """The JSON a rank printed after ``tag``."""
    return json.loads(next(x for x in out.splitlines() if x.startswith(tag + " ")).split(" ", 1)[1])


COLLECTIVES = textwrap.dedent("""
    import cupy as cp, numpy as np, ringcomm
    comm = ringcomm.init(device="gpu")
    n, r = comm.world_size, comm.rank
    assert comm.device == "gpu"
    bad = 0
    for algo in ("ring", "ps", "auto"):
        for count in (0, 1, n - 1, 1009, BIG):
            for dtype in (cp.float16, cp.float32, cp.float64, cp.int32, cp.int64):
                x = (cp.arange(count) % 7 + r).astype(dtype)  # float16 counts only to 2048 exactly
                comm.all_reduce(x, algorithm=algo)
                want = (np.arange(count) % 7) * n + n * (n - 1) // 2
                bad += int(not np.allclose(cp.asnumpy(x).astype(np.float64), want))
            out = cp.empty(count, cp.float32)
            comm.reduce_scatter(out, cp.ones(count * n, cp.float32) * (r + 1), algorithm=algo)
            bad += int(not bool((out == n * (n + 1) / 2).all()))
            g = cp.empty(count * n, cp.int64)
            comm.all_gather(g, cp.full(count, r, cp.int64), algorithm=algo)
            bad += int(not np.array_equal(cp.asnumpy(g), np.repeat(np.arange(n), count)))
            for root in range(n):
                b = cp.full(count, r, cp.float32)
                comm.broadcast(b, root=root, algorithm=algo)
                bad += int(not bool((b == root).all()))
                y = cp.full(count, r + 1.0, cp.float32)
                comm.reduce(y, root=root, op="max", algorithm=algo)
                bad += int(not bool((y == (n if r == root else r + 1)).all()))
                if algo == "ring":  # gather and scatter go straight to or from their root
                    continue
                whole = cp.empty(count * n, cp.float32) if r == root else None
                comm.gather(whole, cp.full(count, r, cp.float32), root=root, algorithm=algo)
                if r == root:
                    bad += int(not np.array_equal(cp.asnumpy(whole), np.repeat(np.arange(n, dtype=np.float32), count)))
                piece = cp.empty(count, cp.int32)
                src = cp.arange(count * n, dtype=cp.int32) if r == root else None
                comm.scatter(piece, src, root=root, algorithm=algo)
                bad += int(not np.array_equal(cp.asnumpy(piece), np.arange(r * count, (r + 1) * count, dtype=np.int32)))
            if algo != "ps":
                mixed = cp.arange(count * n, dtype=cp.float64) + 1000 * r
                got = cp.empty(count * n, cp.float64)
                comm.all_to_all(got, mixed, algorithm=algo)
                want = np.concatenate([np.arange(r * count, (r + 1) * count) + 1000.0 * s for s in range(n)])
                bad += int(not np.array_equal(cp.asnumpy(got), want))
                splits = [(s + r) % 2 for s in range(n)]  # uneven: some ranks send nothing to some
                theirs = [(r + s) % 2 for s in range(n)]
                uneven_in = cp.full(sum(splits), r, cp.int64)
                uneven_out = cp.empty(sum(theirs), cp.int64)
                comm.all_to_all(uneven_out, uneven_in, out_splits=theirs, in_splits=splits, algorithm=algo)
                bad += int(not np.array_equal(cp.asnumpy(uneven_out), np.repeat(np.arange(n), theirs)))
    print("BAD", bad, comm._device.copies_out > 0)
""")


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_on_cupy_arrays(n, backend):
    name, env = backend
    script = COLLECTIVES.replace("BIG", "1_000_003" if name == "cuda" else "100_003")
    for out in job_outputs(script, n, env, timeout=240):
        assert "BAD 0 True" in out, out


# Host arrays on a GPU rank: a memmap and a numpy subclass go together as any two numpy
# arrays do (unstaged); either beside a device array is refused before anything is sent.
HOST_KINDS = textwrap.dedent("""
    import os, tempfile, cupy as cp, numpy as np, ringcomm
    comm = ringcomm.init(device="gpu")
    n, r = comm.world_size, comm.rank

    class Tagged(np.ndarray):
        pass

    with tempfile.TemporaryDirectory() as folder:
        mm = np.memmap(os.path.join(folder, "x"), np.float32, "w+", shape=(3,))
        mm[:] = r
        host = np.empty(3 * n, np.float32)
        comm.all_gather(host.view(Tagged), mm)
        ok = np.array_equal(host, np.repeat(np.arange(n, dtype=np.float32), 3))
        refused = []
        for out, x in ((cp.empty(3 * n, cp.float32), mm), (host.view(Tagged), cp.zeros(3, cp.float32))):
            try:
                comm.all_gather(out, x)
            except TypeError as exc:
                refused.append("both must be numpy arrays or both arrays of the device" in str(exc))
        del mm
    print("HOST", ok, refused)
""")


def test_host_subclasses_beside_host_and_device_arrays(backend):
    name, env = backend
    for out in job_outputs(HOST_KINDS, 2, env, timeout=120):
        assert "HOST True [True, True]" in out, out


# The caller works on a stream of its own (non-blocking: no implicit order with any other
# stream), or with per-thread default streams; the input is produced on that stream just
# before the call, and the result read on it just after. Only the stream contract orders
# them: the collective waits for an event recorded at submission; wait() (and a synchronous
# return) make the caller's stream wait for the completion event; synchronize() blocks the
# host, so even an unrelated stream then sees the result.
STREAMS = textwrap.dedent("""
    import os, cupy as cp, numpy as np, ringcomm
    comm = ringcomm.init(device="gpu")
    n, r = comm.world_size, comm.rank
    mine = cp.cuda.Stream(non_blocking=True) if os.environ["CALLER"] == "non-blocking" else None
    bad = []

    def check(what, got, want):
        if not np.array_equal(got, want):
            bad.append(what)

    def on_caller_stream():
        return mine if mine is not None else cp.cuda.get_current_stream()

    for count in (1, 4099, 300_007):
        base = np.arange(count, dtype=np.float32)
        for mode in ("sync", "wait", "synchronize"):
            with on_caller_stream() as s:
                x = cp.arange(count, dtype=cp.float32) + r          # produced on s
                w = comm.all_reduce(x, algorithm="ring", async_op=mode != "sync")
                if mode == "wait":
                    w.wait()
                elif mode == "synchronize":
                    w.synchronize()
                if mode == "synchronize":  # the host blocked: any stream sees the result
                    other = cp.cuda.Stream(non_blocking=True)
                    got = cp.asnumpy(x, stream=other)
                else:
                    got = cp.asnumpy(x * 2, stream=s) / 2            # consumed on s
            check(("all_reduce", count, mode), got, base * n + n * (n - 1) / 2)
        with on_caller_stream() as s:
            big = cp.arange(count * n, dtype=cp.float32) * (r + 1)
            out = cp.empty(count, cp.float32)
            comm.reduce_scatter(out, big, async_op=True).wait()
            got = cp.asnumpy(out + 0, stream=s)
        check(("reduce_scatter", count), got, np.arange(count * n, dtype=np.float32)[r * count:(r + 1) * count] * (n * (n + 1) / 2))
        with on_caller_stream() as s:
            g = cp.empty(count * n, cp.float32)
            comm.all_gather(g, cp.full(count, r, cp.float32), async_op=True).wait()
            got = cp.asnumpy(g + 0, stream=s)
        check(("all_gather", count), got, np.repeat(np.arange(n, dtype=np.float32), count))
        with on_caller_stream() as s:
            b = cp.full(count, r + 5, cp.float32)
            comm.broadcast(b, root=n - 1, async_op=True).wait()
            got = cp.asnumpy(b + 0, stream=s)
        check(("broadcast", count), got, np.full(count, n + 4, np.float32))
    # a receive posted before its send: the communication thread finishes it
    with on_caller_stream() as s:
        buf = cp.zeros(5000, cp.float32)
        if r == 0:
            w = comm.recv(buf, src=1, async_op=True)
            comm.barrier()
            w.wait()
            check("recv", cp.asnumpy(buf + 0, stream=s), np.arange(5000, dtype=np.float32) + 1)
        elif r == 1:
            comm.barrier()
            comm.send(cp.arange(5000, dtype=cp.float32) + 1, dst=0)
        else:
            comm.barrier()
    # a thread that never made the rank's device current waits for a call made here (as a
    # torch future's completer does): its stream of the rank's device must be the one ordered
    import threading
    x = cp.arange(3000, dtype=cp.float32) + r
    w = comm.all_reduce(x, async_op=True)
    seen = {}

    def waiter():
        w.wait()
        with cp.cuda.Device(comm._device.index):
            seen["got"] = cp.asnumpy(x + 0)
    t = threading.Thread(target=waiter)
    t.start()
    t.join()
    check("waited on another thread", seen.get("got"), np.arange(3000, dtype=np.float32) * n + n * (n - 1) / 2)
    print("BAD", bad)
""")


@pytest.mark.parametrize("caller", ["non-blocking", "per-thread"])
@pytest.mark.parametrize("n", [2, 3])
def test_stream_order_with_the_callers_stream(n, caller, backend):
    name, env = backend
    env = dict(env, CALLER=caller, CUPY_CUDA_PER_THREAD_DEFAULT_STREAM="1" if caller == "per-thread" else "0")
    for out in job_outputs(STREAMS, n, env, timeout=240):
        assert "BAD []" in out, out


# How segments cross between device and host, on the stand-in (whose GPU moves only when
# asked, so a polled copy is still running when the next segment is staged): the root of a
# chain broadcast stages segment k+1 before it hands segment k to the transport, and blocks
# on a copy only at the end of the call; segments between ranks of a host are copied
# straight into and out of registered lane slots; receives land in their destination or
# one reused device buffer, so a warmed-up collective allocates no device memory per segment.
STAGING = textwrap.dedent("""
    import json, cupy as cp, numpy as np, ringcomm
    from cupy import _runtime
    from ringcomm.device import StagedDevice
    from ringcomm.staging import StagingQueue
    comm = ringcomm.init(device="gpu")
    n, r = comm.world_size, comm.rank
    log = []
    stage_out, hand_over = StagedDevice.stage_out, StagingQueue.hand_over_first
    StagedDevice.stage_out = lambda self, a, slot=None: (log.append("stage"), stage_out(self, a, slot))[1]
    StagingQueue.hand_over_first = lambda self: (log.append("hand"), hand_over(self))[1]
    segments = 32
    x = cp.arange(segments * 65536, dtype=cp.float32) + r  # 256 KiB segments: through lanes
    comm.all_reduce(x + 0); comm.broadcast(x + 0, root=0)  # warm-up: the landing buffer is made
    counts = _runtime.counts
    before = dict(counts); log.clear()
    slots = comm._device.slot_copies
    comm.broadcast(x, root=0, algorithm="ring")
    slots = comm._device.slot_copies - slots
    hands = [log[:i].count("stage") for i, what in enumerate(log) if what == "hand"]
    overlapped = sum(staged >= k + 2 for k, staged in enumerate(hands))
    broadcast = {"waits": counts["host waits"] - before.get("host waits", 0),
                 "allocations": counts["allocations"] - before.get("allocations", 0),
                 "events": counts["events"] - before.get("events", 0),
                 "overlapped": overlapped, "hands": len(hands), "slot_copies": slots,
                 "registered": _runtime.pinned_bytes.get("registered", 0)}
    ok = bool((x == cp.arange(segments * 65536, dtype=cp.float32)).all())
    y = cp.arange(segments * 65536, dtype=cp.float32) * (r + 1)
    before = dict(counts)
    comm.all_reduce(y, algorithm="ring")
    reduced = {"allocations": counts["allocations"] - before.get("allocations", 0),
               "events": counts["events"] - before.get("events", 0)}
    ok &= bool((y == cp.arange(segments * 65536, dtype=cp.float32) * (n * (n + 1) // 2)).all())
    part = cp.empty(segments * 65536 // n, cp.float32)
    whole = cp.arange(part.size * n, dtype=cp.float32) * (r + 1)
    comm.reduce_scatter(part, whole + 0, algorithm="ring")  # warm-up
    before = dict(counts)
    comm.reduce_scatter(part, whole, algorithm="ring")  # partial sums pass on in received buffers
    scattered = {"allocations": counts["allocations"] - before.get("allocations", 0)}
    ok &= bool((part == cp.arange(part.size * r, part.size * (r + 1), dtype=cp.float32) * (n * (n + 1) // 2)).all())
    comm.close()  # the lanes' registrations are undone before they are unmapped
    print("STAGING", json.dumps({"ok": ok, "broadcast": broadcast, "reduced": reduced, "scattered": scattered,
                                 "registered_after_close": _runtime.pinned_bytes.get("registered", 0)}))
""")


def test_staging_is_double_buffered_and_receives_reuse_device_memory(backend):
    name, env = backend
    if name != "standin":
        pytest.skip("counts the stand-in's operations; a GPU runs the same path in the other tests")
    # lanes of 128 slots, more than the calls before the measured broadcast can hold (a slot
    # waits for its copy to the device): none of its segments falls back to ZeroMQ
    env = dict(env, RINGCOMM_SEGMENT_BYTES=str(256 << 10), RINGCOMM_SHM_SLOTS="128")
    for rank, out in enumerate(job_outputs(STAGING, 3, env, timeout=120)):
        got = reported(out, "STAGING")
        line, broadcast = json.dumps(got), got["broadcast"]
        assert got["ok"], line
        assert got["reduced"]["allocations"] == 0, f"rank {rank}: device memory per received segment: {line}"
        assert got["scattered"]["allocations"] == 0, f"rank {rank}: device memory per partial sum: {line}"
        assert broadcast["allocations"] == 0, f"rank {rank}: {line}"
        # a warmed-up call's segment copies reuse events: only the call's own are new (the
        # caller's "ready" and the call's "done", per collective), none per segment
        assert broadcast["events"] <= 4 and got["reduced"]["events"] <= 4, f"rank {rank}: events per segment: {line}"
        if rank == 0:  # the root sends segment after segment: each copy overlaps a hand-over
            assert broadcast["overlapped"] >= 31, f"segment k+1 not staged before k went out: {line}"
        # every segment went straight between the device and a registered lane slot
        assert broadcast["slot_copies"] == (32 if rank in (0, 2) else 64), line
        assert broadcast["registered"] >= 256 << 10 and got["registered_after_close"] == 0, line
        if rank < 2:  # rank 2 ends the chain: it only receives
            assert broadcast["hands"] == 32, line
            assert broadcast["waits"] <= 4, f"rank {rank}: the host blocked per segment: {line}"


# Which stream each piece of a staged ring all-reduce goes on, on the stand-in: copies out,
# copies in and reduce kernels each on one of their own, so that a GPU can run a ring step's
# three at once. The result is still the sum: the stand-in carries out each stream's work
# only when forced, so a missing order between two of them reads poison or a stale segment.
STEP_STREAMS = textwrap.dedent("""
    import json, cupy as cp, ringcomm
    from cupy import _runtime
    comm = ringcomm.init(device="gpu")
    n, r, dev = comm.world_size, comm.rank, comm._device
    x = cp.arange(16 * 16384, dtype=cp.float32) * (r + 1)  # 16 segments of 64 KiB
    comm.all_reduce(x + 0, algorithm="ring")  # warm-up
    queued, launch = [], _runtime.Stream.launch

    def logged(self, fn, what="work", any_device=False):
        queued.append((what, self))
        return launch(self, fn, what, any_device)
    _runtime.Stream.launch = logged
    comm.all_reduce(x, algorithm="ring")
    _runtime.Stream.launch = launch
    names = {id(dev.stream): "communication", id(dev.out_stream): "out", id(dev.in_stream): "in"}
    kinds = {"a device -> host copy": "copy out", "a host -> device copy": "copy in"}
    seen = {}
    for what, stream in queued:
        kind = kinds.get(what, "reduction" if what.startswith("kernel reduce") else None)
        if kind is not None:
            seen.setdefault(kind, set()).add(names.get(id(stream), repr(stream)))
    ok = bool((x == cp.arange(16 * 16384, dtype=cp.float32) * (n * (n + 1) // 2)).all())
    print("STEP", json.dumps({"ok": ok, "streams": {k: sorted(v) for k, v in seen.items()},
                             "distinct": len(names) == 3}))
""")


@pytest.mark.parametrize("n", [2, 3])
def test_a_ring_steps_copies_and_reductions_go_on_streams_of_their_own(n, backend):
    name, env = backend
    if name != "standin":
        pytest.skip("counts the stand-in's operations; a GPU runs the same path in the other tests")
    env = dict(env, RINGCOMM_SEGMENT_BYTES="65536")
    for rank, out in enumerate(job_outputs(STEP_STREAMS, n, env, timeout=120)):
        got = reported(out, "STEP")
        assert got["ok"] and got["distinct"], f"rank {rank}: {got}"
        assert got["streams"] == {"copy out": ["out"], "copy in": ["in"], "reduction": ["communication"]}, \
            f"rank {rank}: {got}"


# The device's own order between its copies out and what comes after them, one process:
# a copy in over bytes a copy out still reads, and a kernel after a receive that writes what
# is being sent, both before the host has seen the copy out finish. The collectives never
# leave a copy out unfinished across a receive (they hand every staged segment over first),
# so only this device-level case shows these two orders missing.
OVERLAP = textwrap.dedent("""
    import json, cupy as cp, numpy as np
    from ringcomm.device.cuda import CudaDevice
    dev = CudaDevice(0, slot_bytes=1 << 16)
    count = 4096
    with dev.running(None):
        x = cp.arange(count, dtype=cp.float32)
        over = dev.stage_out(x)
        dev.stage_in(np.full(count, 7, np.float32), into=x)  # lands where the copy out reads
        y = cp.arange(count, dtype=cp.float32) * 2
        under = dev.stage_out(y)
        y += dev.stage_in(np.ones(count, np.float32))  # writes what is being sent
        done = dev.done()
    done.synchronize()
    want = np.arange(count, dtype=np.float32)
    print("OVERLAP", json.dumps({
        "sent before landing": bool(np.array_equal(over.host, want)),
        "landed": bool((x == 7).all()),
        "sent before the kernel": bool(np.array_equal(under.host, want * 2)),
        "reduced": bool((y == cp.asarray(want * 2 + 1)).all())}))
""")


def test_copies_in_and_kernels_wait_for_the_copies_out_that_read_their_bytes(backend):
    _, env = backend
    out = subprocess.run([sys.executable, "-c", OVERLAP], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = reported(out.stdout, "OVERLAP")
    assert all(got.values()), got


# A device send larger than the point-to-point window, to a receiver that comes late: the
# segments staged but not yet handed over count against the window, or the sender would
# pass it and the receiver refuse the data.
WINDOW = textwrap.dedent("""
    import time, cupy as cp, numpy as np, ringcomm
    comm = ringcomm.init(device="gpu")
    x = cp.arange(8 * 8192, dtype=cp.float64)  # 8 segments of 64 KiB, a window of 4
    if comm.rank == 0:
        comm.send(x, 1, tag=3)
        print("WINDOW sent")
    else:
        time.sleep(1.5)
        y = cp.zeros_like(x)
        comm.recv(y, 0, tag=3)
        print("WINDOW", bool((y == x).all()))
""")


def test_staged_sends_respect_the_point_to_point_window(backend):
    name, env = backend
    env = dict(env, RINGCOMM_SEGMENT_BYTES="65536", RINGCOMM_P2P_WINDOW_BYTES=str(4 * 65536))
    out0, out1 = job_outputs(WINDOW, 2, env, timeout=60)
    assert "WINDOW sent" in out0 and "WINDOW True" in out1, out0 + out1


MLP = ("--steps", "5", "--batch-size", "64", "--samples", "512", "--layers", "32,64,48,10")
GPT = ("--model", "gpt", "--steps", "3", "--batch-size", "4", "--n-layer", "2", "--n-head", "2",
       "--d-model", "16", "--seq-len", "16", "--vocab", "256")


def train(strategy, device, tmp_path, extra=(), env=None, model=MLP, nproc=2):
    path = tmp_path / f"{strategy}-{device}.npz"
    cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(nproc), "--device", device, "-m",
           "ringcomm.train", "--strategy", strategy, *model, "--save", str(path), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, **(env or {})))
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(path)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The CPU run of a layout, trained once for both backends."""
    runs = {}

    def run(strategy, extra, model=MLP, nproc=2):
        key = strategy, extra, model, nproc
        if key not in runs:
            runs[key] = train(strategy, "cpu", tmp_path_factory.mktemp("cpu"), extra, model=model, nproc=nproc)
        return runs[key]
    return run


LAYOUTS = {  # test id (what gpu_check selects) -> (strategy, extra arguments)
    "dp": ("dp", ()), "ddp": ("ddp", ()), "zero1": ("zero1", ()), "zero2": ("zero2", ()),
    "zero3": ("zero3", ()), "zero2_offload_fp32": ("zero2", ("--offload",)),
    "zero2_offload_fp16": ("zero2", ("--offload", "--precision", "fp16")),
    "zero3_fp16": ("zero3", ("--precision", "fp16")), "ddp_tp2": ("ddp", ("--tp", "2")),
    "ddp_pp2": ("ddp", ("--pp", "2")),
    "zero2_fp16_clip": ("zero2", ("--precision", "fp16", "--clip-grad-norm", "0.5")),
    "ddp_clip": ("ddp", ("--clip-grad-norm", "0.5")),
    "zero1_offload_fp16": ("zero1", ("--offload", "--precision", "fp16")),
    "zero3_offload_fp32": ("zero3", ("--offload",)),
    "zero3_offload_fp16": ("zero3", ("--offload", "--precision", "fp16", "--bucket-mb", "0.01"))}


@pytest.mark.parametrize("strategy,extra", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_training_on_gpu_matches_cpu(strategy, extra, tmp_path, backend, cpu_run):
    name, env = backend
    reports = tmp_path / "standin"
    if name == "standin":
        reports.mkdir()
        env = dict(env, CUPY_STANDIN_REPORT=str(reports))
    gpu = train(strategy, "gpu", tmp_path, extra, env)
    cpu = cpu_run(strategy, extra)
    for key in cpu.files:
        assert np.allclose(gpu[key], cpu[key], rtol=1e-4, atol=1e-6), key
    if name == "standin":  # each rank trained on its own device, with the reduce kernels
        done = [json.loads(p.read_text()) for p in reports.glob("*.json")]
        ranks = [d for d in done if d.get("kernels")]
        assert len(ranks) == 2, done
        devices = sorted(k for d in ranks for k in d if k.startswith("on device"))
        assert devices == ["on device 0", "on device 1"], devices
        for d in ranks:
            assert d["operations"] > 100 and d["device_peak_bytes"] > 4 * 32 * 64, d


GPT_LAYOUTS = {  # test id -> (strategy, extra arguments, ranks)
    "gpt_cp2": ("ddp", ("--cp", "2"), 2),
    "gpt_tp2_sp_zero3": ("zero3", ("--tp", "2", "--sp"), 4),
    "gpt_pp2_recompute_fp16": ("ddp", ("--pp", "2", "--recompute", "--precision", "fp16"), 2)}


@pytest.mark.parametrize("strategy,extra,nproc", list(GPT_LAYOUTS.values()), ids=list(GPT_LAYOUTS))
def test_gpt_on_gpu_matches_cpu(strategy, extra, nproc, tmp_path, backend, cpu_run):
    """The GPT's layouts on the device train as on the CPU; its positions reach the device
    once, not with every step's indexing (on the stand-in: no numpy index array uploaded)."""
    name, env = backend
    reports = tmp_path / "standin"
    if name == "standin":
        reports.mkdir()
        env = dict(env, CUPY_STANDIN_REPORT=str(reports))
    gpu = train(strategy, "gpu", tmp_path, extra, env, model=GPT, nproc=nproc)
    cpu = cpu_run(strategy, extra, GPT, nproc)
    for key in cpu.files:
        assert np.allclose(gpu[key], cpu[key], rtol=1e-4, atol=1e-5), key
    if name == "standin":
        ranks = [d for d in (json.loads(p.read_text()) for p in reports.glob("*.json")) if d.get("kernels")]
        assert len(ranks) == nproc, ranks
        for d in ranks:  # the positions are copied to the device once, as arrays of their own
            assert d.get("index uploads", 0) == 0, d


# The offloaded optimizer's copies, on the stand-in: each unit's gradient slice goes down on
# the copy stream without blocking the host, and after the host's Adam step on one unit's
# slice that slice goes up on the copy stream before the host updates the next unit.
OFFLOAD = textwrap.dedent("""
    import json, sys
    import cupy as cp, numpy as np
    from cupy import _array
    from ringcomm.train import optim
    from ringcomm.train.parallel import zero
    from ringcomm.train.cli import main
    log, made = [], []
    get, put, update, setup = _array.ndarray.get, _array.ndarray.set, optim.Adam.update, zero.Zero.setup

    def logged_get(self, stream=None, order="C", out=None, blocking=True):
        log.append(("down", stream, blocking, self.size))
        return get(self, stream, order, out, blocking)

    def logged_set(self, arr, stream=None):
        log.append(("up", stream))
        return put(self, arr, stream)
    _array.ndarray.get, _array.ndarray.set = logged_get, logged_set
    optim.Adam.update = lambda self, *a, **k: (log.append(("adam",)), update(self, *a, **k))[1]
    zero.Zero.setup = lambda self, params: (made.append(self), setup(self, params))[1]
    main(sys.argv[1:])
    z = made[0]
    copies = [e for e in log if e[0] == "adam" or (len(e) > 1 and e[1] is z._copies)]
    shard_gets = [e for e in log if e[0] == "down" and e[2] and e[3] == z.layout.shard_total]
    # the device parameters ended as the host master rounded to their dtype, bit for bit
    own = z.param_shard if z.sharded("params") else z.layout.own_shard(z.flat_params, z.rank)
    same = np.array_equal(cp.asnumpy(own).view(np.uint16), z.master.astype(z.dtype).view(np.uint16))
    print("OFFLOAD", json.dumps({"units": len(z.layout.units), "order": [e[0] for e in copies],
          "blocking": [e[2] for e in copies if e[0] == "down"], "shard_gets": len(shard_gets),
          "device_params_are_master": same}))
""")


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_offloaded_copies_use_the_copy_stream_unit_by_unit(stage, backend):
    name, env = backend
    if name != "standin":
        pytest.skip("records the stand-in's copies; a GPU runs the same path in the training tests")
    script = OFFLOAD + "\n"
    args = ["--strategy", stage, "--offload", "--device", "gpu", "--steps", "2", "--batch-size", "32",
            "--samples", "128", "--layers", "32,64,48,10", "--bucket-mb", "0.0005", "--precision", "fp16"]
    for out in job_outputs(script.replace("sys.argv[1:]", repr(args)), 2, env, timeout=120):
        got = reported(out, "OFFLOAD")
        units, order = got["units"], got["order"]
        assert units >= 3, got
        assert order.count("down") == 2 * units and not any(got["blocking"]), got
        assert got["shard_gets"] == 0, "the gradient shard crossed in one blocking copy"
        assert got["device_params_are_master"], "the device parameters differ from the host master"
        updates = [e for e in order if e != "down"]
        stepped = updates.count("adam")  # fp16: a step skipped for overflow updates nothing
        assert stepped in (units, 2 * units) and updates == ["adam", "up"] * stepped, order
