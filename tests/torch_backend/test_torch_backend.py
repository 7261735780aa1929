"""The "ringcomm" torch.distributed backend under real launchers, against Gloo.

Each test starts real ranks (``python -m ringcomm.launch`` or ``torchrun``) running a worker
script of this folder; the workers compare ringcomm with a Gloo group of the same ranks in
the same processes and write their findings as JSON.
"""
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch backend needs PyTorch (make test installs the CPU wheel)")

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(240)


def launch(tmp_path, script, n, *args, launcher="ringcomm", timeout=200):
    """Run ``script`` on n ranks; each rank's JSON report, in rank order."""
    if launcher == "ringcomm":
        cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(n)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
               "--master-port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    done = subprocess.run([*cmd, os.path.join(HERE, script), str(tmp_path), *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_verb_matches_gloo(tmp_path, n):
    for rank, report in enumerate(launch(tmp_path, "verbs_worker.py", n)):
        cases = dict(report)
        assert len(cases) >= 125, f"rank {rank} ran only {len(cases)} cases"
        assert "all_reduce torch.bfloat16 RedOpType.SUM bitwise on every rank" in cases
        assert ("a group its members alone create" in cases) == (rank < 2)
        problems = {case: problem for case, problem in report if problem}
        assert not problems, f"rank {rank}: {problems}"


@pytest.mark.parametrize("n", [2, 3])
def test_torch_trainers_match_gloo(tmp_path, n):
    """DDP in its variants, ZeroRedundancyOptimizer and FSDP2 train to Gloo's parameters
    (1e-6 relative), every ringcomm rank bitwise the same. The fp16 hook sums half-precision
    numbers: in another order (N > 2) they round apart by up to half-precision's epsilon."""
    reports = launch(tmp_path, "training_worker.py", n)
    for rank, report in enumerate(reports):
        assert len(report) == 8, report
        for variant, outcome in report.items():
            assert "error" not in outcome, f"rank {rank} {variant}: {outcome}"
            bound = 2e-3 if variant == "ddp_fp16_hook" and n > 2 else 1e-6
            assert outcome["relative"] <= bound, f"rank {rank} {variant}: {outcome}"
            assert outcome["identical"], f"rank {rank} {variant}: ranks differ"


@pytest.mark.parametrize("n", [3, 4])  # an odd and an even ring; N = 2 adds nothing to the order
def test_powersgd_with_several_buckets_matches_one_process(tmp_path, n):
    """With inline futures, PowerSGD's callbacks and the autograd thread issue collectives in
    one order on every rank, whatever the number of buckets (1, 2 and 4 here)."""
    for rank, report in enumerate(launch(tmp_path, "powersgd_worker.py", n)):
        assert list(report) == ["1", "2", "4"], (rank, report)
        for buckets, outcome in report.items():
            assert "error" not in outcome, (rank, buckets, outcome["error"][:1500])
            assert outcome["buckets_seen"] == int(buckets), (rank, buckets, outcome)
            assert outcome["relative"] < 1e-5 and outcome["identical"], (rank, buckets, outcome)


def test_hooks_in_crossed_order_raise_on_every_rank(tmp_path):
    for rank, report in enumerate(launch(tmp_path, "training_worker.py", 2, "crossed_hooks")):
        assert "CollectiveMismatch" in report["crossed_hooks"], (rank, report)


def test_under_torchrun(tmp_path):
    """torchrun's store holds MASTER_PORT; ringcomm's rendezvous takes its own port."""
    for rank, report in enumerate(launch(tmp_path, "verbs_worker.py", 2, launcher="torchrun")):
        problems = {case: problem for case, problem in report if problem}
        assert len(report) >= 125 and not problems, f"rank {rank}: {problems}"


def test_the_groups_timeout_bounds_a_wait(tmp_path):
    """The timeout given to init_process_group is ringcomm's deadline for the group's waits."""
    zero, _ = launch(tmp_path, "timeout_worker.py", 2)
    assert zero["error"] == "CommTimeout" and 2.9 < zero["seconds"] < 7, zero
    # the words PyTorch's own barrier-timeout tests search for, and the rank that stayed away
    assert re.search(" (Timed out|closed|timeout) ", zero["words"]) and "rank 1" in zero["words"], zero
