"""A dead rank is named within about a second whatever it forked.

Rank 2 of 3 forks a child that only sleeps (``os.fork``, or ``multiprocessing`` with the fork
start method, as a DataLoader with workers does), then is SIGKILLed. The child holds copies of
rank 2's ZeroMQ connections, so no disconnect reaches anyone; every survivor must still raise
PeerLost naming rank 2 within a few seconds, through the pidfd it holds on rank 2's process
(see ringcomm.transport.liveness), not after its 30 s deadline. Run with and without ringcomm's
launcher (without: the torchrun-style variables of tests/harness.py).
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import spawn_job
from ringcomm.transport.liveness import start_time

pytestmark = pytest.mark.timeout(90)

FORKED = textwrap.dedent("""
    import os, signal, time, numpy as np, ringcomm
    from ringcomm.transport.liveness import start_time
    comm = ringcomm.init()
    x = np.ones(1 << 16, np.float32)
    comm.all_reduce(x)

    def hold():  # the child: holds copies of rank 2's sockets and bells (not its output)
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        time.sleep(60)

    if comm.rank == 2:
        if os.environ["TEST_FORK"] == "os.fork":
            child = os.fork()
            if child == 0:
                hold()
                os._exit(0)
        else:
            import multiprocessing as mp
            worker = mp.get_context("fork").Process(target=hold, daemon=True)
            worker.start()
            child = worker.pid
        with open(os.environ["TEST_CHILD_FILE"], "w") as f:
            f.write(f"{child} {start_time(child)}")
        time.sleep(0.5)  # the others wait for it in the next all-reduce
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    try:
        for _ in range(100_000):
            comm.all_reduce(x)
        print("no error", flush=True)
    except ringcomm.CommError as exc:
        print(f"{type(exc).__name__} rank={exc.rank} after={time.monotonic() - t:.2f} {exc}", flush=True)
        raise  # under the launcher: its report names the rank this one blames
""")


def kill_child(pid_file):
    """SIGKILL the child rank 2 forked, if it is still the process it wrote down."""
    try:
        pid, start = Path(pid_file).read_text().split()
    except (OSError, ValueError):
        return
    if start_time(int(pid)) == int(start):
        os.kill(int(pid), signal.SIGKILL)


def check_survivors(outputs):
    """``outputs``: {rank: what it printed}; each survivor named rank 2 in a PeerLost, soon."""
    for rank, out in outputs.items():
        found = re.search(r"(\w+) rank=(\S+) after=([\d.]+) (.*)", out)
        assert found, f"rank {rank} printed no error: {out!r}"
        kind, blamed, after, message = found.groups()
        assert (kind, blamed) == ("PeerLost", "2"), f"rank {rank}: {out}"
        assert "ended without a goodbye" in message, f"rank {rank}: {out}"  # seen by its pid
        assert float(after) < 5.0, f"rank {rank} took {after}s: {out}"


@pytest.mark.parametrize("fork", ["os.fork", "multiprocessing"])
def test_a_killed_rank_with_a_forked_child_is_named_at_once(tmp_path, fork):
    pid_file = tmp_path / "child"
    try:
        results = spawn_job(FORKED, 3, timeout=60, env={
            "RINGCOMM_TIMEOUT": "30", "TEST_FORK": fork, "TEST_CHILD_FILE": str(pid_file)})
    finally:
        kill_child(pid_file)
    assert results[2][0] == -signal.SIGKILL, results[2]
    check_survivors({rank: results[rank][1] + results[rank][2] for rank in (0, 1)})


@pytest.mark.parametrize("fork", ["os.fork", "multiprocessing"])
def test_a_killed_rank_with_a_forked_child_is_named_at_once_under_the_launcher(tmp_path, fork):
    script, pid_file = tmp_path / "forked.py", tmp_path / "child"
    script.write_text(FORKED)
    scrubbed = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "RINGCOMM_SECRET", "RINGCOMM_TIMEOUT", "RINGCOMM_JOB_ID")
    env = {k: v for k, v in os.environ.items() if k not in scrubbed}
    env.update(TEST_FORK=fork, TEST_CHILD_FILE=str(pid_file))
    try:
        done = subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", "3",
                               "--timeout", "30", str(script)],
                              env=env, capture_output=True, text=True, timeout=60)
    finally:
        kill_child(pid_file)
    lines = {rank: "\n".join(line for line in done.stdout.splitlines()
                             if line.startswith(f"[rank {rank}]: ")) for rank in (0, 1)}
    check_survivors(lines)
    assert done.returncode == 1, done.stderr  # rank 2 was killed
    assert "rank 2 was lost by its peers" in done.stderr, done.stderr
