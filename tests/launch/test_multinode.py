"""The launcher across "hosts" (two launchers on one machine), and ringcomm.init under
other launchers' environments (Open MPI's mpirun, SLURM's srun)."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from harness import free_port

pytestmark = pytest.mark.timeout(90)

WORKER = textwrap.dedent("""
    import os, numpy as np, ringcomm
    comm = ringcomm.init()
    x = np.arange(100_000, dtype=np.float64) * (comm.rank + 1)
    comm.all_reduce(x, algorithm="ring")
    n = comm.world_size
    ok = np.array_equal(x, np.arange(100_000) * n * (n + 1) / 2)
    print(f"rank={comm.rank} world={n} local={comm.local_rank}/{comm.local_world_size} ok={ok}")
    comm.close()
""")


@pytest.fixture
def worker_script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def launcher(args, env=None):
    return subprocess.Popen([sys.executable, "-m", "ringcomm.launch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_two_launchers_form_one_job(worker_script, transport):
    port = str(free_port())
    env = {"RINGCOMM_SECRET": "ab" * 16, "RINGCOMM_TRANSPORT": transport, "RINGCOMM_TIMEOUT": "30"}
    nodes = [launcher(["--nnodes", "2", "--node-rank", str(node), "--nproc", "2",
                       "--master-addr", "127.0.0.1", "--master-port", port, worker_script], env)
             for node in (1, 0)]  # the non-master node starts first: it must wait for rank 0
    outputs = [p.communicate(timeout=60) for p in nodes]
    for p, (_out, err) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, err
    text = "".join(out for out, _ in outputs)
    for rank in range(4):
        assert f"rank={rank} world=4 local={rank % 2}/2 ok=True" in text, text


@pytest.mark.parametrize("style", ["mpirun", "srun"])
def test_init_under_other_launchers(worker_script, style):
    port, n = str(free_port()), 3
    procs = []
    for rank in range(n):
        if style == "mpirun":
            env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(n),
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)}
        else:
            env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(n), "SLURM_LOCALID": str(rank),
                   "SLURM_NTASKS_PER_NODE": f"{n}(x1)"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RINGCOMM_TIMEOUT="30")
        clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        procs.append(subprocess.Popen([sys.executable, worker_script], env=dict(clean, **env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert f"rank={rank} world={n} local={rank}/{n} ok=True" in out


def test_worker_error_stops_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, ringcomm
        comm = ringcomm.init()
        if comm.rank == 1:
            raise SystemExit(7)
        comm.all_reduce(np.ones(10))   # never completes: rank 1 is gone
    """))
    start = time.monotonic()
    p = launcher(["--nproc", "3", str(script)], {"RINGCOMM_TIMEOUT": "60"})
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0
    # the launcher names the first worker it sees fail: rank 1 itself, or a rank that
    # raised PeerLost because rank 1 left
    assert "rank 1 (local rank 1" in err and "exit code 7" in err \
        or "rank 1 closed its communicator" in err or "cannot send to rank 1" in err, err
    assert time.monotonic() - start < 20
