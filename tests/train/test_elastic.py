"""Training past a lost rank (``--elastic``): real workers under ``ringcomm.launch --on-failure
continue``, SIGKILLed at a chosen step (before it, in the middle of its backward, or right
after its commit point); the survivors rebuild the job and the final parameters equal those of
an uninterrupted run over the same global batches, up to the order of the sums."""
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(240)

# a worker that kills itself where TEST_DEATHS ("rank@step,...") and TEST_WHERE say, then trains
WRAPPER = """
import os, signal, sys
from ringcomm.train import cli, elastic, trainer
from ringcomm.train.parallel import strategy, zero

deaths = dict(tuple(map(int, d.split("@"))) for d in filter(None, os.environ["TEST_DEATHS"].split(",")))
if os.environ.get("RINGCOMM_RESTART_COUNT", "0") != "0":
    deaths = {}  # a restarted job runs whole
where, me, now = os.environ["TEST_WHERE"], int(os.environ["RANK"]), [None]


def die_at(place):
    if where == place and deaths.get(me) == now[0]:
        os.kill(os.getpid(), signal.SIGKILL)


def wrap(cls, name, place, after=False):
    original = getattr(cls, name)

    def wrapped(self, *args):
        if not after:
            die_at(place)
        out = original(self, *args)
        if after:
            die_at(place)
        return out
    setattr(cls, name, wrapped)


batch = trainer.Job.batch
trainer.Job.batch = lambda self, step: (now.__setitem__(0, step), die_at("start"), batch(self, step))[2]
wrap(strategy.Replicated, "finish_backward", "backward")
wrap(zero.Zero, "finish_backward", "backward")
wrap(zero.Zero, "publish", "publish")  # after the commit point and this rank's own update
wrap(elastic.Elastic, "commit", "commit", after=True)
if where == "state":  # the victim dies right after its vote reached the coordinator, who
    # hears a slow rank's vote only later: the step is taken with the victim lost
    from ringcomm import agreements
    send, commit = agreements.Agreements._send, elastic.Elastic.commit

    def send_then_die(self, ident, messages):
        send(self, ident, messages)
        if messages:  # (entering sends nothing while the coordinator has not asked)
            die_at("state")

    def slow_commit(self):
        if deaths and now[0] == min(deaths.values()) and me == int(os.environ["TEST_SLOW"]):
            import time
            time.sleep(0.5)
        return commit(self)
    agreements.Agreements._send = send_then_die
    elastic.Elastic.commit = slow_commit
sys.exit(cli.main(sys.argv[1:]))
"""

# a global batch of 50: shares of 12 and 13 rows on 4 ranks, 16 and 17 on 3, 25 on 2
TRAIN = ["--elastic", "--layers", "12,24,4", "--samples", "400", "--batch-size", "50", "--steps", "14",
         "--lr", "0.01"]


def launch(tmp_path, name, deaths="", where="start", extra=(), slow=-1, strategy="ddp", ok=True, launcher=()):
    """Run the job; (the launcher's completed process, the saved parameters, the metrics)."""
    script = tmp_path / "wrapper.py"
    script.write_text(WRAPPER)
    out, metrics = tmp_path / f"{name}.npz", tmp_path / f"{name}.json"
    scrubbed = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "RINGCOMM_SECRET", "RINGCOMM_TIMEOUT", "RINGCOMM_JOB_ID")
    env = {k: v for k, v in os.environ.items() if k not in scrubbed}
    env.update(TEST_DEATHS=deaths, TEST_WHERE=where, TEST_SLOW=str(slow))
    done = subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", "4", "--on-failure", "continue",
                           "--timeout", "30", *launcher, str(script), *TRAIN, "--strategy", strategy, *extra, "--save",
                           str(out), "--metrics-json", str(metrics)], env=env, capture_output=True, text=True,
                          timeout=200)
    if not ok:
        return done, None, None
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with np.load(out) as saved:
        params = dict(saved)
    return done, params, json.loads(metrics.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (four ranks throughout)."""
    _, params, metrics = launch(tmp_path_factory.mktemp("reference"), "reference")
    assert metrics["recoveries"] == []
    return params, metrics


@pytest.mark.parametrize("strategy, deaths, where, lost, taken", [
    ("ddp", "2@5", "start", [[2]], [(6, False)]),                    # 4 -> 3 between steps
    ("ddp", "1@3,3@9", "backward", [[1], [3]], [(4, False), (10, False)]),  # in backward, twice: 4 -> 2
    ("ddp", "3@6", "commit", [[3]], [(8, False)]),  # just after step 7 was agreed on: it stands, 8 is redone
    # ZeRO: a lost shard from its successor's copy, twice (4 -> 3 -> 2)
    ("zero1", "2@5,0@9", "start", [[2], [0]], [(6, False), (10, False)]),
    ("zero2", "1@3,3@9", "backward", [[1], [3]], [(4, False), (10, False)]),
    ("zero3", "0@6,2@10", "commit", [[0], [2]], [(8, False), (12, False)]),  # rank 0's shard: rank 1's copy
    # lost after its update, in the gather of the updated shards: step 7 stands, and every
    # survivor votes against step 8 (those whose gather completed fail it) and redoes it
    ("zero2", "2@6", "publish", [[2]], [(8, False)]),
])
def test_survivors_rebuild_and_end_where_the_uninterrupted_run_ends(tmp_path, reference, strategy, deaths, where,
                                                                     lost, taken):
    done, params, metrics = launch(tmp_path, "elastic", deaths, where, strategy=strategy)
    ref_params, ref_metrics = reference
    recoveries = metrics["recoveries"]
    assert [r["lost"] for r in recoveries] == lost, recoveries
    assert [(r["step"], r["step_taken"]) for r in recoveries] == taken, recoveries
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=2e-4, atol=2e-6, err_msg=name)
    np.testing.assert_allclose(metrics["losses"], ref_metrics["losses"], rtol=2e-4)
    assert len(metrics["losses"]) == 14  # every step once: a redone step is not counted twice
    for r in recoveries:
        assert re.search(rf"lost rank\(s\) \[{r['lost'][0]}\] in step {r['step']}; going on with \d ranks",
                         done.stdout), done.stdout
    assert re.search(r"rank \d \(local rank \d, pid \d+\) was lost: killed by signal 9", done.stderr), done.stderr


@pytest.mark.parametrize("strategy, seed", [("ddp", 1), ("zero1", 2), ("zero2", 3), ("zero3", 4)])
def test_two_ranks_killed_at_random_steps(tmp_path, reference, strategy, seed):
    """Two ranks (never both of a rank and the one after it, whose copy it needs), at
    random steps and places in the step: 4 -> 3 -> 2, ending where the uninterrupted run ends."""
    rng = random.Random(seed)
    first = rng.randrange(4)
    second = rng.choice([r for r in range(4) if r != first and r not in ((first + 1) % 4, (first - 1) % 4)])
    steps = sorted(rng.sample(range(1, 13), 2))
    where = rng.choice(["start", "backward"])
    done, params, metrics = launch(tmp_path, "random", f"{first}@{steps[0]},{second}@{steps[1]}", where,
                                   strategy=strategy)
    assert [r["lost"] for r in metrics["recoveries"]] == [[first], [second]], (metrics["recoveries"], done.stdout)
    for name, value in reference[0].items():
        np.testing.assert_allclose(params[name], value, rtol=2e-4, atol=2e-6, err_msg=name)
    assert len(metrics["losses"]) == 14


def test_a_model_parallel_job_falls_back_to_its_checkpoint_by_itself(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    done, params, metrics = launch(tmp_path, "tp", "3@5", "start", extra=[
        "--tp", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--resume"],
        launcher=["--max-restarts", "1"])
    assert "tp, pp and cp layouts cannot recover a lost rank in memory" in done.stdout, done.stdout
    assert "restarting all workers" in done.stderr and "(step 4" in done.stdout, done.stderr[-2000:]
    for name, value in reference[0].items():
        np.testing.assert_allclose(params[name], value, rtol=2e-4, atol=2e-6, err_msg=name)


def test_a_step_taken_while_a_rank_was_lost_is_not_redone(tmp_path, reference):
    done, params, metrics = launch(tmp_path, "taken", "3@6", "state", slow=2)
    assert [(r["step"], r["lost"], r["step_taken"]) for r in metrics["recoveries"]] == [(7, [3], True)], \
        metrics["recoveries"]
    assert "lost rank(s) [3] in step 7; going on with 3 ranks (step taken)" in done.stdout, done.stdout
    for name, value in reference[0].items():
        np.testing.assert_allclose(params[name], value, rtol=2e-4, atol=2e-6, err_msg=name)
    assert len(metrics["losses"]) == 14


def test_a_rank_lost_with_the_one_keeping_its_copy_ends_the_job_saying_so(tmp_path):
    done, _, _ = launch(tmp_path, "both", "1@5,2@5", "backward", strategy="zero2", ok=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert re.search(r"the model state of rank\(s\) \[1\] is in no survivor's memory: each was lost together "
                     r"with the rank after it, which kept its copy; continue from the last checkpoint", done.stderr), \
        done.stderr[-3000:]


def test_with_restarts_that_job_falls_back_to_its_last_checkpoint(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    done, params, metrics = launch(tmp_path, "fallback", "1@5,2@5", "backward", strategy="zero2",
                                   extra=["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--resume"],
                                   launcher=["--max-restarts", "1"])
    assert "is in no survivor's memory" in done.stderr and "restarting all workers" in done.stderr, done.stderr
    assert "resuming from" in done.stdout and "(step 4" in done.stdout, done.stdout
    for name, value in reference[0].items():
        np.testing.assert_allclose(params[name], value, rtol=2e-4, atol=2e-6, err_msg=name)


def test_the_copy_costs_one_shard_of_optimizer_state_and_its_gradient(tmp_path):
    _, _, metrics = launch(tmp_path, "copied", strategy="zero2")
    rank = metrics["per_rank"][0]
    measured, formula = rank["model_state_bytes"], rank["predicted_model_state_bytes"]
    phi, n = rank["num_params"], 4
    assert measured["optimizer"] == formula["optimizer"] == (8 + 12) * phi / n  # own m, v; the copy's master, m, v
    # the all-reduce's 2(n-1)/n of the fp32 gradient, and the gradient shard to the successor
    assert rank["dp_bytes_sent_per_step"] == rank["dp_bytes_predicted_per_step"] == (2 * 3 / 4 + 1 / 4) * 4 * phi


def test_model_parallel_and_the_parameter_server_say_they_fall_back_to_checkpoints(tmp_path):
    for extra, words in ((["--strategy", "dp"], "keeps the optimizer state on rank 0 alone"),
                         (["--tp", "2"], "tp, pp and cp layouts cannot recover a lost rank in memory")):
        done, _, metrics = launch(tmp_path, "fallback", extra=extra)
        assert words in done.stdout and "--resume continues it from its last checkpoint" in done.stdout, done.stdout
        assert metrics["recoveries"] == []
