"""A rank that closes after a failure says in its goodbye whom the failure blamed, so that its
peers blame the rank that failed first, never the survivor that closed.

Over real processes: rank 2 of 3 forks a child that holds its connections (so nobody sees
them drop) and is SIGKILLed; rank 0, which watches rank 2's process, fails its receive from
rank 2 and closes. Rank 1 does not watch rank 2's process (``liveness.WATCH`` off in it) and
waits on rank 0: all it ever learns is rank 0's goodbye, and its error must name rank 2. No
timing decides the outcome: rank 1 has no other way to hear of rank 2. Below it, the BYE's
encoding (see ringcomm.transport.goodbye and ringcomm.transport.connections) on its own.
"""
import re
import signal
import struct
import textwrap

import pytest

from harness import spawn_job
from ringcomm.errors import CollectiveMismatch, CommError, CommTimeout, PeerLost
from ringcomm.transport.goodbye import PLAIN as PLAIN_BYE, reason as goodbye_reason, sig_for as goodbye_sig

from test_forked_rank_dies import kill_child

pytestmark = pytest.mark.timeout(90)

CLOSES_AFTER_A_LOSS = textwrap.dedent("""
    import os, signal, time, numpy as np, ringcomm
    from ringcomm.transport import liveness
    if os.environ["RANK"] == "1":
        liveness.WATCH = False  # rank 1 hears of rank 2's death only through rank 0's goodbye
    comm = ringcomm.init()
    buf = np.zeros(4, np.float32)
    if comm.rank == 2:
        child = os.fork()
        if child == 0:  # holds copies of rank 2's connections: none of them drops
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            time.sleep(60)
            os._exit(0)
        with open(os.environ["TEST_CHILD_FILE"], "w") as f:
            f.write(f"{child} {liveness.start_time(child)}")
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    try:
        comm.recv(buf, 2 if comm.rank == 0 else 0)  # rank 0 never sends to rank 1
        print("no error", flush=True)
    except ringcomm.CommError as exc:
        print(f"{type(exc).__name__} rank={exc.rank} after={time.monotonic() - t:.2f} {exc}", flush=True)
        if comm.rank == 0:
            comm.close()
""")


def test_a_rank_waiting_on_one_that_closed_after_a_loss_blames_the_lost_rank(tmp_path):
    pid_file = tmp_path / "child"
    try:
        results = spawn_job(CLOSES_AFTER_A_LOSS, 3, timeout=60, env={
            "RINGCOMM_TIMEOUT": "30", "TEST_CHILD_FILE": str(pid_file)})
    finally:
        kill_child(pid_file)
    assert results[2][0] == -signal.SIGKILL, results[2]
    outs = {rank: results[rank][1] for rank in (0, 1)}
    for rank, out in outs.items():
        found = re.search(r"(\w+) rank=(\S+) after=([\d.]+) (.*)", out)
        assert found, f"rank {rank}: {results[rank]}"
        assert found.group(1, 2) == ("PeerLost", "2"), f"rank {rank}: {out}"
        assert float(found.group(3)) < 5.0, f"rank {rank}: {out}"
    assert "rank 0 closed after losing rank 2" in outs[1], outs[1]


@pytest.mark.parametrize("failure, said", [
    (None, None),
    (PeerLost("lost", rank=2), (PeerLost, 2, None)),
    (CommTimeout("late", rank=1, cause="silent"), (CommTimeout, 1, "silent")),
    (CommTimeout("late", rank=3, cause="not started"), (CommTimeout, 3, "not started")),
    (CollectiveMismatch("differ"), (CollectiveMismatch, None, None)),
    (ValueError("not a communication error"), (CommError, None, None)),
])
def test_the_goodbye_carries_the_first_failure(failure, said):
    sig = goodbye_sig(failure)
    assert len(sig) == 16 and goodbye_reason(sig, world_size=4) == said
    if failure is None:
        assert sig == PLAIN_BYE == bytes(16)  # as every goodbye was before
    else:  # the ABORT's layout: code u8, rank u32 (0xFFFFFFFF: none), cause u8, zeros
        code, rank, cause = struct.unpack("<BIB10x", sig)
        assert code in (1, 2, 3, 4) and rank == (0xFFFFFFFF if said[1] is None else said[1])


def test_a_goodbye_blaming_a_rank_outside_the_world_blames_none():
    assert goodbye_reason(goodbye_sig(PeerLost("x", rank=7)), world_size=4) == (PeerLost, None, None)
