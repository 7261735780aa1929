"""ringcomm.init() under the launchers clusters already run, started for real: torchrun
(whose agent's store holds MASTER_PORT, and a restart), Open MPI's mpirun, and SLURM's srun on
a one-machine SLURM stood up for the test. Skipped, saying why, where a launcher is not
installed (or, for SLURM, cannot be stood up here: not root, daemons that do not start)."""
import os
import shutil
import subprocess
import sys

import pytest

from ringcomm.env import free_port

pytestmark = pytest.mark.timeout(120)

CHECK = r'''
import os, sys
import numpy as np, ringcomm
comm = ringcomm.init(timeout=60)
x = np.full(5, comm.rank + 1.0)
comm.all_reduce(x)
evens = comm.new_group([r for r in range(comm.world_size) if r % 2 == 0])
y = np.array([comm.rank])
if evens is not None:
    evens.broadcast(y, root=evens.world_size - 1)
with open(os.path.join(sys.argv[1], f"rank{comm.rank}.txt"), "w") as f:  # launchers mix stdout
    f.write(f"rank={comm.rank} size={comm.world_size} local={comm.local_rank} sum={x[0]} evens={y[0]}")
comm.close()
'''


def run(cmd, tmp_path, env=None, replace=False):
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    done = subprocess.run([*cmd, str(script), str(tmp_path)], capture_output=True, text=True, timeout=100,
                          env=dict(env if replace else dict(os.environ, **(env or {})), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return sorted(path.read_text() for path in tmp_path.glob("rank*.txt"))


def expected(n):
    top_even = (n - 1) // 2 * 2
    return sorted(f"rank={r} size={n} local={r} sum={n * (n + 1) / 2} evens={top_even if r % 2 == 0 else r}"
                  for r in range(n))


@pytest.mark.parametrize("n", [2, 3])
def test_under_torchrun(tmp_path, n):
    """torchrun's agent holds MASTER_PORT for its store; ringcomm's rendezvous takes its own."""
    pytest.importorskip("torch", reason="torchrun comes with PyTorch (make test installs the CPU wheel)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    assert run(cmd, tmp_path) == expected(n)


def test_under_mpirun(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    port = free_port("127.0.0.1")
    cmd = ["mpirun", "-np", "2", "--oversubscribe", *root, "--mca", "btl_tcp_if_include", "lo",
           "--mca", "oob_tcp_if_include", "lo", "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}",
           "-x", "OMP_NUM_THREADS", sys.executable]
    assert run(cmd, tmp_path) == expected(2)


RESTART = r'''
import os, sys
import numpy as np, ringcomm
comm = ringcomm.init(timeout=30)
x = np.full(3, comm.rank + 1.0)
comm.all_reduce(x)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(sys.argv[1], f"attempt{attempt}-rank{comm.rank}.txt"), "w") as f:
    f.write(str(x[0]))
if attempt == "0" and comm.rank == 1:
    os._exit(3)  # the agent restarts both workers: a new world, through the same store
comm.close()
'''


def test_restart_under_torchrun(tmp_path):
    """A worker killed in the first generation: torchrun restarts the group, and the new
    generation agrees on its rendezvous afresh and finishes."""
    pytest.importorskip("torch", reason="torchrun comes with PyTorch")
    script = tmp_path / "restart.py"
    script.write_text(RESTART)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "1", str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=100, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert {p.name: p.read_text() for p in tmp_path.glob("attempt*.txt")} == {
        "attempt0-rank0.txt": "3.0", "attempt0-rank1.txt": "3.0", "attempt1-rank0.txt": "3.0",
        "attempt1-rank1.txt": "3.0"}


def test_under_srun(tmp_path):
    """srun -n 4 on a one-machine SLURM stood up for the test (tests/launch/slurm_cluster.py)."""
    from slurm_cluster import Unavailable, cluster
    try:
        with cluster() as env:
            port = free_port("127.0.0.1")
            lines = run(["srun", "-n", "4", "-O", "--export",
                         f"ALL,MASTER_ADDR=127.0.0.1,MASTER_PORT={port},OMP_NUM_THREADS=1", sys.executable],
                        tmp_path, env=env, replace=True)
    except Unavailable as why:
        pytest.skip(f"no one-machine SLURM here: {why}")
    assert lines == expected(4)
