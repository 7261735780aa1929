"""The CuPy stand-in (tests/standin) enforces the rules it exists for: a test of the GPU
path that passes on it must not pass by the stand-in's leniency. Run in a fresh process with
the stand-in first on the path, so this process never imports a ``cupy``."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
STANDIN = Path(__file__).resolve().parents[1] / "standin"

CHECKS = textwrap.dedent("""
    import json, threading, numpy as np, cupy as cp, cupyx
    seen = {}

    def raises(fn):
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as exc:
            return type(exc).__name__
        return None

    a = cp.arange(4, dtype=cp.float32)
    seen["own type"] = not isinstance(a, np.ndarray)
    seen["mix refused"] = raises(lambda: a + np.ones(4, np.float32))
    seen["implicit conversion refused"] = raises(lambda: np.asarray(a))
    seen["copyto refused"] = raises(lambda: np.copyto(np.empty(4, np.float32), a))
    cp.cuda.Device().synchronize()

    other = cp.cuda.Stream(non_blocking=True)
    b = a * 10                                  # on the null stream, not yet run
    seen["stale without a wait"] = cp.asnumpy(b, stream=other).tolist()
    c = a * 100
    e = cp.cuda.get_current_stream().record()
    other.wait_event(e)
    seen["after wait_event"] = cp.asnumpy(c, stream=other).tolist()

    host = cupyx.empty_pinned(4, np.float32)
    host[...] = 7
    d = cp.empty(4, cp.float32)
    d.set(host, stream=other)                   # from pinned memory: read when the stream runs
    host[...] = 8
    seen["pinned source read late"] = cp.asnumpy(d, stream=other).tolist()
    seen["pinned bytes"] = cp.pinned_bytes()["allocated"]

    out = cupyx.empty_pinned(4, np.float32)
    out[...] = -1
    f = a + 1
    f.get(stream=other, out=out, blocking=False)
    seen["async copy not there before sync"] = out.tolist()
    other.synchronize()

    with cp.cuda.Device(1):
        g = cp.zeros(4, cp.float32)
    seen["other device refused"] = raises(lambda: g + 1)
    seen["device per thread"] = []
    t = threading.Thread(target=lambda: seen["device per thread"].append(cp.cuda.Device().id))
    with cp.cuda.Device(2):
        t.start(); t.join()
    seen["view shares memory"] = a[1:3].data.ptr == a.data.ptr + 4
    z = cp.zeros(1, cp.int32)
    z += 5                                       # deferred
    w = cp.zeros(2, cp.float64)
    w[0] = z[0]                                  # an element is a 0-d view, read in stream order
    seen["element in stream order"] = float(w[0])

    page = np.zeros(8192, np.uint8)              # registered host memory, as a lane slot is
    region = page[4096:]
    address = region.__array_interface__["data"][0]
    cp.cuda.runtime.hostRegister(address, region.nbytes, 1)
    seen["registered twice refused"] = raises(lambda: cp.cuda.runtime.hostRegister(address, 16, 1))
    region[:4] = 3
    h = cp.empty(4, cp.uint8)
    h.set(region[:4], stream=other)              # read later, by address
    region[:4] = 4
    ev = other.record()
    polls = 0
    while not ev.done:                           # the polled GPU moves on
        polls += 1
    seen["registered source read late"] = cp.asnumpy(h, stream=other).tolist()
    seen["event polled"] = polls
    cp.cuda.runtime.hostUnregister(address)
    seen["unregistered twice refused"] = raises(lambda: cp.cuda.runtime.hostUnregister(address))

    with cp.cuda.Device(1):                      # device 1's default stream, used from device 0
        k = cp.arange(4, dtype=cp.float32) * 3   # queued on device 1's null stream
        one = cp.cuda.Event()
    handle = cp.cuda.get_current_stream(1)       # the default stream's handle: device 0's here
    marker = handle.record()                     # an event of device 0, on device 0's stream
    waiter = cp.cuda.Stream(non_blocking=True)
    waiter.wait_event(marker)                    # orders nothing of device 1
    seen["default handle means the current device"] = cp.asnumpy(k, stream=waiter).tolist()
    seen["event of another device refused"] = raises(lambda: one.record(cp.cuda.get_current_stream(0)))
    with cp.cuda.Device(1):
        late = cp.arange(4, dtype=cp.float32) + 1   # queued on device 1's default stream
    # a copy made with device 0 current runs with the array's device current, as CuPy's
    # get() does: on device 1's default stream, after the work that wrote the array
    seen["get under the array's device"] = late.get().tolist()
    with cp.cuda.get_current_stream(1):              # the default stream's handle: any device
        seen["default handle entered anywhere"] = True
    m0 = cp._runtime.counts["device mallocs"]
    tmp = cp.empty(1000, cp.float32); del tmp          # freed into the pool
    again = cp.empty(1000, cp.float32)                 # served by the freed block
    kept = cp.empty(1000, cp.float32)                  # the pool has none left: a malloc
    seen["pool"] = cp._runtime.counts["device mallocs"] - m0
    del again, kept
    ix = cp.arange(6, dtype=cp.float32)
    seen["numpy index taken"] = ix[np.array([5, 0])].tolist()
    seen["index uploads"] = cp._runtime.counts["index uploads"]
    seen["reshape of a transpose copies"] = (ix.reshape(2, 3).T.reshape(-1).tolist(),
                                              cp.shares_memory(ix, ix.reshape(2, 3).T.reshape(-1)))
    print(json.dumps(seen))
""")


def test_the_standin_defers_refuses_and_tracks():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]),
               CUPY_CUDA_PER_THREAD_DEFAULT_STREAM="0")
    proc = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["own type"]
    assert seen["mix refused"] == "TypeError"
    assert seen["implicit conversion refused"] == "TypeError"
    assert seen["copyto refused"] == "TypeError"
    assert all(v != v for v in seen["stale without a wait"])  # NaN: fresh memory's poison
    assert seen["after wait_event"] == [0.0, 100.0, 200.0, 300.0]
    assert seen["pinned source read late"] == [8.0] * 4
    assert seen["pinned bytes"] == 16
    assert seen["async copy not there before sync"] == [-1.0] * 4
    assert seen["other device refused"] == "ValueError"
    assert seen["device per thread"] == [0]  # a new thread starts on device 0, as in CUDA
    assert seen["view shares memory"]
    assert seen["element in stream order"] == 5.0
    assert seen["registered twice refused"] == "CUDARuntimeError"
    assert seen["registered source read late"] == [4] * 4
    assert seen["event polled"] >= 1, "an event was done before its stream moved"
    assert seen["unregistered twice refused"] == "CUDARuntimeError"
    assert all(v != v for v in seen["default handle means the current device"])  # never waited for
    assert seen["event of another device refused"] == "CUDARuntimeError"
    assert seen["get under the array's device"] == [1.0, 2.0, 3.0, 4.0]
    assert seen["pool"] == 2  # the first block, then the one the pool could not serve
    assert seen["default handle entered anywhere"]
    assert seen["numpy index taken"] == [5.0, 0.0] and seen["index uploads"] == 1
    assert seen["reshape of a transpose copies"] == [[0.0, 3.0, 1.0, 4.0, 2.0, 5.0], False]
