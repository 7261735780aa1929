"""A lost rank is not a lost job: real processes SIGKILLed, the survivors shrink and go on.

Each script runs under the torchrun-style variables of tests/harness.py (no launcher, which
would stop the survivors), checks every all-reduce against its closed form over the members
left, and prints what it saw for the test to compare across ranks.
"""
import os
import re
import signal
import subprocess
import sys

import pytest

from harness import spawn_job

pytestmark = pytest.mark.timeout(120)

STEPS = 24
# each rank: all-reduces of (global rank + 1); a victim kills itself at the start of its
# step; a survivor that loses a peer shrinks, and the survivors redo the first step one of
# them had not finished (a peer may die after some finished a step and before others did)
KILLS = """
import os, signal, time, numpy as np, ringcomm
comm = ringcomm.init()
me = comm.rank
deaths = dict(tuple(map(int, d.split("@"))) for d in os.environ["TEST_DEATHS"].split(","))  # rank@step
pending = None
if me == 0:  # a receive nobody will answer: the shrink must fail it, naming the lost ranks
    pending = comm.recv(np.empty(4), 1, tag=99, async_op=True)
x, step, shrinks = np.empty(2048), 0, []
while step < int(os.environ.get("TEST_STEPS", {steps})):
    if deaths.get(me) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    x[:] = me + 1.0
    try:
        comm.all_reduce(x)
    except ringcomm.PeerLost as exc:
        t = time.monotonic()
        comm = comm.shrink()
        done = np.array([step], np.int64)
        comm.all_reduce(done, op="min")
        shrinks.append(f"{{comm.ranks}}@{{int(done[0])}}:{{time.monotonic() - t:.2f}}s")
        step = int(done[0])
        continue
    assert np.all(x == sum(r + 1 for r in comm.ranks)), (x[0], comm.ranks)
    step += 1
if pending is not None:
    try:
        pending.wait()
        print("pending: completed")
    except ringcomm.PeerLost as exc:  # (RanksLost once the revocation reached it first)
        print(f"pending: {{type(exc).__name__}} rank={{exc.rank}} {{exc}}")
print(f"final ranks={{list(comm.ranks)}} rank={{comm.rank}} id={{comm.comm_id}} shrinks={{shrinks}}", flush=True)
comm.close()
""".format(steps=STEPS)


def finals(results, survivors):
    """{rank: (ranks, group rank, comm id)} from each survivor's last line."""
    seen = {}
    for rank in survivors:
        code, out, err = results[rank]
        assert code == 0, f"rank {rank}: exit {code}: {out[-2000:]} {err[-3000:]}"
        found = re.search(r"final ranks=(\[.*?\]) rank=(\d+) id=(\d+)", out)
        assert found, out
        seen[rank] = (eval(found.group(1)), int(found.group(2)), int(found.group(3)))
    return seen


@pytest.mark.parametrize("deaths", ["2@5", "2@5,0@12", "3@0,1@7"])
def test_survivors_shrink_and_every_result_stays_right(deaths):
    dead = {int(d.split("@")[0]) for d in deaths.split(",")}
    results = spawn_job(KILLS, 4, env={"TEST_DEATHS": deaths}, timeout=100)
    for rank in dead:
        assert results[rank][0] == -signal.SIGKILL, results[rank]
    survivors = sorted(set(range(4)) - dead)
    seen = finals(results, survivors)
    assert {s[0] == survivors for s in seen.values()} == {True}, seen  # every survivor: the same members
    assert [seen[r][1] for r in survivors] == list(range(len(survivors)))  # renumbered in order
    assert len({s[2] for s in seen.values()}) == 1  # one communicator id everywhere
    if 0 not in dead:  # the old communicator's receive in flight failed, naming a lost rank
        found = re.search(r"pending: (PeerLost|RanksLost) rank=(\d+)", results[0][1])
        assert found and int(found.group(2)) in dead, results[0][1]


# rank 2 dies; rank 0 (which coordinates the agreement of the three left) is killed after
# it sent its first agreement messages: COLLECT to rank 1 alone; PROPOSE to rank 1 alone;
# COMMIT to rank 1 alone (rank 1 has decided, rank 3 has not: rank 1 must lead the next round)
DURING = """
import os, signal, numpy as np, ringcomm
from ringcomm import agreements
comm = ringcomm.init()
if comm.rank == 0:
    sent, kill_after = [0], int(os.environ["TEST_KILL_AFTER"])
    send = agreements.Agreements._send

    def send_then_die(self, ident, messages):
        for message in messages:
            send(self, ident, [message])
            sent[0] += 1
            if sent[0] == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    agreements.Agreements._send = send_then_die
if comm.rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
x = np.ones(8)
while True:
    try:
        comm.all_reduce(x)
        break
    except ringcomm.PeerLost:
        comm = comm.shrink()
x[:] = comm.ranks[comm.rank]
comm.all_reduce(x)
assert x[0] == sum(comm.ranks), (x, comm.ranks)
print(f"final ranks={list(comm.ranks)} rank={comm.rank} id={comm.comm_id}", flush=True)
comm.close()
"""


@pytest.mark.parametrize("kill_after", [1, 3, 5])
def test_the_coordinator_killed_during_the_agreement(kill_after):
    results = spawn_job(DURING, 4, env={"TEST_KILL_AFTER": str(kill_after)}, timeout=100)
    assert results[0][0] == -signal.SIGKILL and results[2][0] == -signal.SIGKILL, results
    seen = finals(results, [1, 3])
    assert seen[1][0] == seen[3][0] == [1, 3], seen
    assert seen[1][2] == seen[3][2]


REVOKE = """
import time, numpy as np, ringcomm
comm = ringcomm.init()
t = time.monotonic()
try:
    if comm.rank == 0:
        time.sleep(0.5)
        comm.revoke()
        comm.all_reduce(np.ones(2))  # its own calls fail too
    elif comm.rank == 1:
        comm.recv(np.empty(3), 0, tag=4)  # rank 0 never sends: the revocation ends the wait
    else:
        comm.all_reduce(np.ones(2))  # rank 0 never joins
    print("no error")
except ringcomm.Revoked as exc:
    print(f"Revoked after={time.monotonic() - t:.2f} {exc}", flush=True)
"""


def test_revoke_fails_every_pending_call_on_every_member_at_once():
    results = spawn_job(REVOKE, 3, timeout=60)
    for rank, (code, out, err) in enumerate(results):
        found = re.search(r"Revoked after=([\d.]+) (.*)", out)
        assert code == 0 and found, f"rank {rank}: {out} {err[-2000:]}"
        assert "rank 0 revoked world" in found.group(2), out
        assert float(found.group(1)) < 10, out  # long before the 20 s deadline


# a group shrinks, its members alone taking part, while another group without the lost rank
# goes on (rank 3, outside the shrunk group, never hears of it)
GROUPS = """
import os, signal, numpy as np, ringcomm
comm = ringcomm.init()
a, b = comm.new_group([0, 1, 2]), comm.new_group([0, 1, 3])
if comm.rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
x = np.ones(4)
if a is not None:
    try:
        a.all_reduce(x)
    except ringcomm.PeerLost:
        a = a.shrink()
    x[:] = comm.rank + 1.0
    a.all_reduce(x)
    assert list(a.ranks) == [0, 1] and x[0] == 3.0, (a.ranks, x)
for _ in range(20):
    y = np.full(4, comm.rank + 1.0)
    b.all_reduce(y)
    assert y[0] == 1 + 2 + 4, y
print(f"final ranks={list(b.ranks)} rank={b.rank} id={b.comm_id}", flush=True)
comm.barrier = None  # the world holds a lost rank: it is not used again
"""


def test_a_group_shrinks_while_another_goes_on():
    results = spawn_job(GROUPS, 4, timeout=100)
    seen = finals(results, [0, 1, 3])
    assert {s[0] == [0, 1, 3] for s in seen.values()} == {True}


def _launch(tmp_path, script, *options, steps=STEPS):
    path = tmp_path / "job.py"
    path.write_text(script)
    scrubbed = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "RINGCOMM_SECRET", "RINGCOMM_TIMEOUT", "RINGCOMM_JOB_ID")
    env = {k: v for k, v in os.environ.items() if k not in scrubbed}
    env.update(TEST_DEATHS="2@5", TEST_STEPS=str(steps))
    return subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", "4", "--timeout", "20",
                           *options, str(path)], env=env, capture_output=True, text=True, timeout=100)


def test_the_launcher_keeps_the_survivors_running_when_asked(tmp_path):
    done = _launch(tmp_path, KILLS, "--on-failure", "continue")
    assert done.returncode == 0, done.stderr
    assert re.search(r"rank 2 \(local rank 2, pid \d+\) was lost: killed by signal 9 \(SIGKILL\); "
                     r"3 rank\(s\) here go on", done.stderr), done.stderr
    assert "every worker ended: 3 of 4 exited 0; lost rank(s) [2]" in done.stderr, done.stderr
    finals_seen = re.findall(r"\[rank (\d)\]: final ranks=\[0, 1, 3\]", done.stdout)
    assert sorted(finals_seen) == ["0", "1", "3"], done.stdout


def test_by_default_the_launcher_still_ends_the_job(tmp_path):
    done = _launch(tmp_path, KILLS, steps=10**7)  # the survivors would run for hours
    assert done.returncode == 1, done.stderr
    assert re.search(r"rank 2 \(local rank 2, pid \d+\) failed: killed by signal 9", done.stderr), done.stderr
    assert "final ranks" not in done.stdout  # the survivors were stopped


def test_a_survivor_that_fails_on_its_own_fails_the_job(tmp_path):
    script = KILLS.replace("comm.close()", "comm.close()\nif me == 1:\n    raise SystemExit(3)")
    done = _launch(tmp_path, script, "--on-failure", "continue")
    assert done.returncode == 1, done.stderr
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) was lost: exit code 3", done.stderr), done.stderr


def test_continue_with_restarts_restarts_a_job_that_failed_as_a_whole(tmp_path):
    script = ("import os, sys\n"
              "sys.exit(3 if os.environ['RINGCOMM_RESTART_COUNT'] == '0' and os.environ['RANK'] == '1' else 0)\n")
    done = _launch(tmp_path, script, "--on-failure", "continue", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr
    assert "rank 1 (local rank 1" in done.stderr and "restarting all workers (restart 1 of 1)" in done.stderr, \
        done.stderr


# agree() as a commit point: rank 3 dies at a random moment inside a stream of all-reduces;
# each survivor passes whether its own last all-reduce completed, and every survivor must
# learn the same outcome (a rank may finish the all-reduce its neighbour failed)
AGREE = """
import os, random, signal, time, numpy as np, ringcomm
comm = ringcomm.init()
flags = [r != 1 for r in range(comm.world_size)]
print("plain", comm.agree(flags[comm.rank]))  # no loss: the AND of the flags, nobody lost
try:
    comm.agree(1)
except TypeError as exc:
    print("refused", exc)
rng = random.Random(int(os.environ["TEST_SEED"]))
at = rng.uniform(0.05, 0.3)
x, start, ok = np.ones(1 << 14), time.monotonic(), True
while True:
    if comm.rank == 3 and time.monotonic() - start > at:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(x)
    except ringcomm.PeerLost:
        ok = False
        break
    if time.monotonic() - start > 5:
        break
outcome = comm.agree(ok)
print(f"outcome {outcome}", flush=True)
"""


@pytest.mark.parametrize("seed", range(3))
def test_agree_gives_every_survivor_one_outcome(seed):
    results = spawn_job(AGREE, 4, env={"TEST_SEED": str(seed)}, timeout=100)
    assert results[3][0] == -signal.SIGKILL, results[3]
    outcomes = set()
    for rank in (0, 1, 2):
        code, out, err = results[rank]
        assert code == 0, f"rank {rank}: {err[-2000:]}"
        assert "plain (False, ())" in out and "refused agree() takes a bool" in out, out
        outcomes.add(re.search(r"outcome (.*)", out).group(1))
    assert len(outcomes) == 1, outcomes
    assert outcomes.pop().endswith(", (3,))")  # rank 3 is lost, whatever the flag
