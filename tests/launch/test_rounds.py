"""Restarts across hosts (``--nnodes > 1 --max-restarts K``): two launchers on this machine
agree on every round through node 0's coordinator (ringcomm.launch.rounds); a failure on
either node restarts the workers of both, a node that never comes ends the job, and a
message not signed with the job secret changes nothing. Across real network namespaces:
tests/hosts/test_restarts_across_hosts.py."""
import os
import signal
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


def launchers(tmp_path, fail_rounds, *extra, nodes=(0, 1), port=None, script=FLAKY, nproc=2):
    """One launcher per node of a two-node job running ``script`` (its argument:
    ``fail_rounds``); the processes and the port."""
    path = tmp_path / "job.py"
    path.write_text(script)
    port = port or free_port()
    env = dict(os.environ, RINGCOMM_SECRET=SECRET, PYTHONPATH=REPO)
    return [subprocess.Popen([sys.executable, "-m", "ringcomm.launch", "--nnodes", "2", "--node-rank", str(node),
                              "--nproc", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port), *extra,
                              str(path), str(fail_rounds)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node in nodes], port


def test_a_failure_on_one_node_restarts_both(tmp_path):
    procs, port = launchers(tmp_path, 2, "--max-restarts", "2")
    outs = [p.communicate(timeout=100) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
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


class Raw:
    """A hand-driven connection to a coordinator: it says what a test makes it say."""

    def __init__(self, port, secret, node, nonce="a" * 32):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.secret, self.node, self.nonce, self.theirs = secret, node, nonce, None

    def say(self, n, **doc):
        doc = dict(doc, n=n)
        doc.setdefault("node", self.node)
        doc.setdefault("round", 0)
        self.sock.send(rounds._seal(self.secret, doc))

    def hello(self):
        self.say(1, kind="hello", round=-1, nonce=self.nonce)
        if self.sock.poll(3000):
            doc = rounds._open(self.secret, self.sock.recv())
            self.theirs = doc and doc.get("nonce")
        return self.theirs

    def heard(self, timeout_ms=500):
        """Everything the coordinator sent within ``timeout_ms`` that opens with the secret."""
        docs = []
        while self.sock.poll(timeout_ms):
            docs.append(rounds._open(self.secret, self.sock.recv()))
        return docs

    def close(self):
        self.ctx.destroy(0)


def test_strangers_and_replays_change_nothing():
    """Frames without the secret, and signed frames that are not fresh for their connection
    (as one recorded from another connection or another job would be: another nonce, an old
    counter, another node), are refused: they neither join a node nor decide a round."""
    port, said = free_port(), []
    coordinator = rounds.Coordinator(nnodes=2, max_restarts=1, addr="127.0.0.1", port=port, secret=SECRET,
                                     job="j", worker_port=port + 1, join_timeout=30, log=said.append)
    agents = [rounds.Agent(node=n, addr="127.0.0.1", port=port, secret=SECRET, join_timeout=30) for n in (0, 1)]
    stranger, insider = Raw(port, "ef" * 16, node=1), Raw(port, SECRET, node=0)
    try:
        agents[0].report("join", 0)  # sent once its challenge is in: node 0 is then agent 0's
        while agents[0]._theirs is None or agents[1]._theirs is None:
            agents[0].stop_requested(0)
            agents[1].stop_requested(0)
        time.sleep(0.2)
        stranger.say(1, kind="hello", round=-1, nonce="b" * 32)  # without the secret
        stranger.say(2, kind="join")
        assert insider.hello()  # signed right: a connection of its own, claiming node 0
        insider.say(2, kind="join", node=1, to=insider.theirs)          # another node than its hello's
        insider.say(3, kind="join", node=0, to=agents[1]._theirs)       # another connection's nonce
        insider.say(4, kind="failed", node=0, to=insider.theirs)        # fresh: counts for node 0...
        insider.say(4, kind="quit", node=0, to=insider.theirs)          # ...the same counter again
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert not agents[0].stop_requested(0) and 0 not in agents[0]._go
        refused = "\n".join(said)
        assert "not signed with the job secret" in refused, said
        counts = {what.split(" (")[0]: n for what, n in coordinator._refused.counts.items()}
        assert counts["a message that is not fresh for its connection"] == 3, counts  # logged once
        assert "a second launcher claiming node 0" in refused, said  # agent 0 holds node 0
        assert any(d and d.get("kind") == "refused" for d in insider.heard()), "the claimant was not told"
        assert agents[1].join(0)["port"] == port + 1 and agents[0].join(0)["job"] == "j"
        agents[0].report("failed", 0)
        assert agents[1].verdict(0)[0] == rounds.RESTART
    finally:
        for agent in agents:
            agent.close()
        stranger.close()
        insider.close()
        coordinator.close()


def test_a_second_launcher_for_a_taken_node_is_told():
    port = free_port()
    coordinator = rounds.Coordinator(nnodes=2, max_restarts=1, addr="127.0.0.1", port=port, secret=SECRET,
                                     job="j", worker_port=port + 1, join_timeout=30, log=lambda _: None)
    first = rounds.Agent(node=1, addr="127.0.0.1", port=port, secret=SECRET, join_timeout=30)
    second = rounds.Agent(node=1, addr="127.0.0.1", port=port, secret=SECRET, join_timeout=30)
    try:
        first.report("join", 0)
        while 0 not in first._go and not first._heard:
            first.stop_requested(0)
        time.sleep(0.3)
        with pytest.raises(rounds.RoundsError, match="node 1 already has a launcher in this job"):
            second.join(0)
    finally:
        first.close()
        second.close()
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


SLEEPY = """
import time
print("WORKING", flush=True)
time.sleep(60)
"""


def test_a_signal_to_one_launcher_ends_the_job_on_every_node(tmp_path):
    procs, _ = launchers(tmp_path, 0, "--max-restarts", "2", script=SLEEPY, nproc=1)
    deadline = time.monotonic() + 30
    while "WORKING" not in procs[1].stdout.readline():  # node 1's worker runs: round 0 started
        assert time.monotonic() < deadline
    procs[1].send_signal(signal.SIGTERM)
    (_, err0), (_, err1) = [p.communicate(timeout=60) for p in procs]
    assert procs[1].returncode == 143, err1
    assert "ending the job on every node" in err1, err1
    assert procs[0].returncode == 1 and "node 1's launcher quit: giving up" in err0, err0
    assert "restarting" not in err0 + err1
