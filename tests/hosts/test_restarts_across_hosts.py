"""``--max-restarts`` across hosts: two launchers in two network namespaces train with
checkpoints; a worker on the second host is SIGKILLed mid-run (tests/checkpoint/
kill_at_step.py, first round only); both launchers stop their workers, restart them together
in a new round, ``--resume`` picks up the last checkpoint, and the job ends with the
parameters of an uninterrupted run."""
import json
import os
import re
import secrets
import sys

import pytest

import netns  # bench/netns.py, put on the path by conftest.py
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tests", "checkpoint"))
from ckpt_helpers import restart_args, run_train  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("cluster", [(2, 1)], indirect=True, ids=["2x1"])
def test_worker_killed_on_the_second_host_restarts_every_host(cluster, pools, tmp_path):
    reference = pools(2).run(run_train, dict(strategy="zero2", precision="fp16"), False)[0]
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    args = restart_args(ckpt, metrics)
    script = os.path.join(REPO, "tests", "checkpoint", "kill_at_step.py")
    procs = netns.launch(cluster, ["--max-restarts", "2", script, *map(str, args)], 29781, secrets.token_hex(16),
                         KILL_AT_STEP="5", RINGCOMM_TIMEOUT="20", PYTHONPATH=REPO)
    (out0, rc0), (out1, rc1) = netns.finish(procs, 200)
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    assert "rank 1 (local rank 0" in out1 and "killed by signal 9 (SIGKILL)" in out1, out1[-3000:]
    for out in (out0, out1):  # node 1 reports first as a rule; node 0's ranks fail a moment later
        assert re.search(r"node [01]'s workers failed: restarting the workers of every node \(restart 1 of 2\)",
                         out), out[-3000:]
        assert "restart 2 of 2" not in out
    assert f"resuming from {ckpt}/step_000004 (step 4)" in out0, out0[-3000:]
    document = json.loads(metrics.read_text())
    assert document["resumed_from_step"] == 4
    assert document["param_sha256"] == reference["param_sha256"]
    assert document["losses"] == reference["losses"]
