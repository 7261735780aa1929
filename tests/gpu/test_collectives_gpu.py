"""Collectives on CuPy arrays and the trainer with --device gpu, on real processes.

Processes are started fresh (never forked from this one, which has initialised CUDA)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU collective tests need CuPy")
try:
    _DEVICES = cp.cuda.runtime.getDeviceCount()
except Exception as exc:  # CuPy without a driver
    pytest.skip(f"GPU collective tests need a CUDA device ({exc})", allow_module_level=True)
if _DEVICES < 1:
    pytest.skip("GPU collective tests need a CUDA device; CuPy sees none", allow_module_level=True)

from harness import spawn_job  # noqa: E402

pytestmark = pytest.mark.timeout(300)

COLLECTIVES = textwrap.dedent("""
    import cupy as cp, numpy as np, ringcomm
    comm = ringcomm.init(device="gpu")
    n, r = comm.world_size, comm.rank
    assert comm.device == "gpu"
    bad = 0
    for algo in ("ring", "ps", "auto"):
        for count in (0, 1, n - 1, 1009, 1_000_003):
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
    print("BAD", bad, comm._device.copies_out > 0)
""")


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_on_cupy_arrays(n):
    for code, out, err in spawn_job(COLLECTIVES, n, timeout=240):
        assert code == 0, err
        assert "BAD 0 True" in out, out


def train(strategy, device, tmp_path, extra=()):
    path = tmp_path / f"{strategy}-{device}.npz"
    cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", "2", "--device", device, "-m", "ringcomm.train",
           "--strategy", strategy, "--steps", "5", "--batch-size", "64", "--samples", "512",
           "--layers", "32,64,48,10", "--save", str(path), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(path)


@pytest.mark.parametrize("strategy,extra", [("dp", ()), ("ddp", ()), ("zero1", ()), ("zero2", ()),
                                            ("zero3", ()), ("zero2", ("--offload",))])
def test_training_on_gpu_matches_cpu(strategy, extra, tmp_path):
    gpu = train(strategy, "gpu", tmp_path, extra)
    cpu = train(strategy, "cpu", tmp_path, extra)
    for name in cpu.files:
        assert np.allclose(gpu[name], cpu[name], rtol=1e-4, atol=1e-6), name
