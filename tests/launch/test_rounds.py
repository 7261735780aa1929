"""Restarts across hosts (``--nnodes > 1 --max-restarts K``): two launchers on this machine
agree on every round through node 0's coordinator (ringcomm.launch.rounds); a failure on
either node restarts the workers of both, a node that never comes ends the job, and a
message not signed with the job secret changes nothing. Across real network namespaces:
tests/hosts/test_restarts_across_hosts.py."""
import os
import subprocess
import sys
import time

import pytest
import zmq

from harness import free_port
from ringcomm.launch import rounds

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "cd" * 16

FLAKY = """
import os, sys
n = int(os.environ["RINGCOMM_RESTART_COUNT"])
print(f"ATTEMPT={n} JOB={os.environ['RINGCOMM_JOB_ID']} PORT={os.environ['MASTER_PORT']}")
sys.exit(1 if n < int(sys.argv[1]) and os.environ["RANK"] == "3" else 0)
"""


def launchers(tmp_path, fail_rounds, *extra, nodes=(0, 1), port=None):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    port = port or free_port()
    env = dict(os.environ, RINGCOMM_SECRET=SECRET, PYTHONPATH=REPO)
    return [subprocess.Popen([sys.executable, "-m", "ringcomm.launch", "--nnodes", "2", "--node-rank", str(node),
                              "--nproc", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), *extra,
                              str(script), str(fail_rounds)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node in nodes], port


def test_a_failure_on_one_node_restarts_both(tmp_path):
    procs, port = launchers(tmp_path, 2, "--max-restarts", "2")
    outs = [p.communicate(timeout=100) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "restart 1 of 2" in err and "restart 2 of 2" in err, err
        assert "node 1's workers failed" in err
    lines = [line.split(": ", 1)[1] for out, _ in outs for line in out.splitlines() if "ATTEMPT=2" in line]
    assert len(lines) == 4, outs  # every rank of both nodes ran round 2
    assert len(set(lines)) == 1 and f"PORT={port + 1}" in lines[0], lines  # one job name, one port


def test_restarts_exhausted_on_every_node(tmp_path):
    procs, _ = launchers(tmp_path, 99, "--max-restarts", "1")
    for p in procs:
        out, err = p.communicate(timeout=100)
        assert p.returncode == 1, err
        assert "restart 1 of 1" in err and "giving up after 1 restart(s)" in err, err
        assert "ATTEMPT=2" not in out


def test_a_node_that_never_comes_ends_the_job(tmp_path):
    procs, _ = launchers(tmp_path, 0, "--max-restarts", "1", "--timeout", "2", nodes=(0,))
    out, err = procs[0].communicate(timeout=60)
    assert procs[0].returncode == 1
    assert "node(s) [1] did not join round 0 within 2 s" in err, err
    assert "ATTEMPT" not in out


def test_strangers_and_replays_change_nothing():
    """Frames without the secret, and signed frames that are not fresh for their connection
    (as one recorded from another connection or another job would be), are refused: they
    neither join a node nor decide a round."""
    port, said = free_port(), []
    coordinator = rounds.Coordinator(nnodes=2, max_restarts=1, addr="127.0.0.1", port=port, secret=SECRET,
                                     job="j", worker_port=port + 1, join_timeout=30, log=said.append)
    agents = [rounds.Agent(node=n, addr="127.0.0.1", port=port, secret=SECRET, join_timeout=30) for n in (0, 1)]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(f"tcp://127.0.0.1:{port}")
    try:
        agents[0].report("join", 0)
        assert not agents[1].stop_requested(0)  # agent 1 has its challenge now
        stranger = "ef" * 16
        raw.send(rounds._seal(stranger, {"kind": "hello", "round": -1, "node": 1, "n": 1, "nonce": "a" * 32}))
        raw.send(rounds._seal(stranger, {"kind": "join", "round": 0, "node": 1, "n": 2}))
        # what agent 1 would say next, signed right, sent from another connection
        for n, kind in ((agents[1]._sent + 1, "join"), (agents[1]._sent + 2, "failed")):
            raw.send(rounds._seal(SECRET, {"kind": kind, "round": 0, "node": 1, "n": n, "to": agents[1]._theirs}))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert not agents[0].stop_requested(0) and 0 not in agents[0]._go
        assert any("not signed with the job secret" in line for line in said), said
        assert any("not fresh for its connection" in line for line in said), said
        assert agents[1].join(0)["port"] == port + 1 and agents[0].join(0)["job"] == "j"
        agents[0].report("failed", 0)
        assert agents[1].verdict(0)[0] == rounds.RESTART
    finally:
        for agent in agents:
            agent.close()
        ctx.destroy(0)
        coordinator.close()


def rounds_go(agent, rnd):
    """Whether ``agent`` has round ``rnd``'s GO, after moving its messages once."""
    agent.stop_requested(rnd)
    return rnd in agent._go


def test_a_quit_after_a_restart_ends_the_job():
    port = free_port()
    coordinator = rounds.Coordinator(nnodes=2, max_restarts=3, addr="127.0.0.1", port=port, secret=SECRET,
                                     job="j", worker_port=port + 1, join_timeout=30, log=lambda _: None)
    agents = [rounds.Agent(node=n, addr="127.0.0.1", port=port, secret=SECRET, join_timeout=30) for n in (0, 1)]
    try:
        for agent in agents:
            agent.report("join", 0)  # said once the coordinator's challenge is in
        while not all([rounds_go(agent, 0) for agent in agents]):  # every agent moves
            pass
        agents[1].report("failed", 0)
        assert agents[0].verdict(0)[0] == rounds.RESTART
        agents[1].report("quit", 0)  # node 1's launcher will not join round 1
        go = agents[0].join(1)
        assert go["verdict"] == rounds.GIVE_UP and "quit before round 1" in go["why"], go
    finally:
        for agent in agents:
            agent.close()
        coordinator.close()
