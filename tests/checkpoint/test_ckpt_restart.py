"""``python -m ringcomm.launch --max-restarts``: a worker SIGKILLed mid-training (the
``kill_at_step.py`` wrapper, first attempt only) brings the job down, the
launcher restarts it, ``--resume`` picks up the last checkpoint and the job ends with the
parameters of an uninterrupted run."""
import json
import os
import subprocess
import sys

import pytest

from ckpt_helpers import restart_args, run_train, steps_on_disk, subprocess_env

pytestmark = pytest.mark.timeout(120)


def test_killed_worker_restarts_and_resumes(pools, tmp_path):
    run = dict(strategy="zero2", precision="fp16")
    reference = pools(2).run(run_train, run, False)[0]  # the launched job has the default loss scaler
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    args = restart_args(ckpt, metrics)
    env = subprocess_env(KILL_AT_STEP="5", RINGCOMM_TIMEOUT="20")
    proc = subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", "2", "--max-restarts", "2",
                           os.path.join(os.path.dirname(__file__), "kill_at_step.py"), *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=90)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "rank 1 (local rank 1" in proc.stderr and "killed by signal 9 (SIGKILL)" in proc.stderr, log
    assert "restarting all workers (restart 1 of 2)" in proc.stderr, log
    assert "restart 2 of 2" not in proc.stderr, log  # the hook fires on the first attempt only
    assert f"no complete checkpoint in {ckpt}: starting from step 0" in proc.stdout, log
    assert f"resuming from {ckpt}/step_000004 (step 4)" in proc.stdout, log
    document = json.loads(metrics.read_text())
    assert document["resumed_from_step"] == 4
    assert document["param_sha256"] == reference["param_sha256"], log
    assert document["losses"] == reference["losses"]
    assert steps_on_disk(str(ckpt)) == [6, 8]
