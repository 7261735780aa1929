"""``make gpu-check`` (bench/gpu_check.py) always leaves its JSON: without a GPU it says so
and lists every step as not run; a step that runs out of time is recorded as timed out with
what it printed; steps the budget no longer covers are listed as not run."""
import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_without_a_gpu_the_json_says_so(tmp_path):
    from ringcomm.device import gpu_available
    if gpu_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] is False and "no GPU here" in report["error"]
    assert "subnormal probe" in report["not_run"] and "stream order probes" in report["not_run"] and "zero2 --offload --precision fp32" in report["not_run"]
    assert report["not_run"][:2] == ["first light", "torch backend"]  # what fails first on a new image runs first


def test_a_step_out_of_time_and_one_past_the_budget_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0.5)
    steps = gpu_check.Steps(str(tmp_path / "gpu_check.json"), budget=5)
    slow = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"]
    assert steps.run("slow", slow, timeout=1.5) is None
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] is False
    assert report["timed_out"][0]["step"] == "slow" and "started" in report["timed_out"][0]["tail"]
    steps.end = 0  # the budget is spent
    assert steps.run("never", [sys.executable, "-c", "pass"], timeout=30) is None
    assert "never" in json.loads((tmp_path / "gpu_check.json").read_text())["not_run"]


def test_every_pytest_selection_names_tests_that_exist():
    """A renamed test or layout id would only show on a GPU machine (pytest: "not found")."""
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    for name, selection in gpu_check.PYTESTS:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                               *selection], cwd=root, capture_output=True, text=True, timeout=50)
        if proc.returncode == 5 and "need CuPy" in proc.stdout:
            continue  # a module that skips itself without CuPy (the kernel tests): it is there
        assert proc.returncode == 0, f"{name}: {proc.stdout[-1500:]}{proc.stderr[-1500:]}"
        assert "cuda" in proc.stdout, f"{name} selects no test of the real CuPy: {proc.stdout[-1500:]}"


def _alive(pid):
    """True while ``pid`` runs (a zombie nobody reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _leaving_a_child(pidfile, then):
    """A step's script: it starts a child that sleeps, writes the child's pid to ``pidfile``,
    then runs ``then`` (Python source)."""
    return ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n" + then)


def _gone(pid, wait=5.0):
    """True once ``pid`` has ended, waiting up to ``wait`` seconds for it."""
    deadline = time.monotonic() + wait
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_step_out_of_time_is_killed_with_what_it_started(tmp_path, monkeypatch):
    """A launched job's ranks are the step's grandchildren: they go with it, not on holding
    the GPU through the next steps; every step's seconds are in the JSON."""
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0.5)
    steps = gpu_check.Steps(str(tmp_path / "gpu_check.json"), budget=60)
    pidfile = tmp_path / "rank.pid"
    parent = _leaving_a_child(pidfile, "print('started', flush=True); time.sleep(120)\n")
    assert steps.run("hung job", [sys.executable, "-c", parent], timeout=3) is None
    assert _gone(int(pidfile.read_text())), "the step's rank outlived it"
    quick = steps.run("quick", [sys.executable, "-c", "print('ok')"], timeout=30)
    assert quick.returncode == 0 and quick.stdout.strip() == "ok"
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["step_seconds"]) == {"hung job"} and report["step_seconds"]["hung job"] >= 3
    steps.save()
    assert set(json.loads((tmp_path / "gpu_check.json").read_text())["step_seconds"]) == {"hung job", "quick"}


def test_a_step_that_ends_leaving_a_process_behind_returns_at_once(tmp_path, monkeypatch):
    """A process the step left behind holds its pipes: the step still ends when its own
    process does (not at its time limit), with its exit status, and the leftover is killed."""
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0.5)
    steps = gpu_check.Steps(str(tmp_path / "gpu_check.json"), budget=120)
    pidfile = tmp_path / "left.pid"
    parent = _leaving_a_child(pidfile, "print('done', flush=True)\n")
    began = time.monotonic()
    result = steps.run("leaves one behind", [sys.executable, "-c", parent], timeout=60)
    assert result is not None and result.returncode == 0 and "done" in result.stdout
    assert time.monotonic() - began < 20, "the step waited for what it left behind"
    assert _gone(int(pidfile.read_text()))


# Two of the training runs, one per model: tests/gpu/test_collectives_gpu.py trains each of
# gpu-check's strategies on the stand-in against the CPU already (dp, ddp, ZeRO 1-3, offload
# in fp16 and fp32, the GPT with cp, tp + sp and pp); what is this script's own is how a run
# is started and its metrics read. `make gpu-check-standin` runs all ten.
KEPT_RUNS = [("zero2", ["--offload"]), gpu_check.STRATEGIES[-1]]


@pytest.mark.timeout(300)
def test_every_step_runs_on_the_standin(tmp_path):
    """gpu-check's own scripts (first light, the subnormal probe, the collective benchmark,
    a training run of each model) run and pass on the CuPy stand-in within their time
    limits; the tests/gpu steps and the other training runs are skipped here, as make test
    runs them already."""
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    kept = {gpu_check.label(s, e) for s, e in KEPT_RUNS}
    others = [gpu_check.label(s, e) for s, e in gpu_check.STRATEGIES if gpu_check.label(s, e) not in kept]
    skip = [name for name, _ in gpu_check.PYTESTS] + others
    assert len(kept) == 2 and "--model gpt" in gpu_check.label(*KEPT_RUNS[1])
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--standin", "--out", str(tmp_path),
                           "--skip", ",".join(skip)], cwd=root, capture_output=True, text=True, timeout=280)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0 and report["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["standin"] and not report["not_run"] and "timed_out" not in report
    ran = set(report["step_seconds"])
    assert ran == {"first light", "subnormal probe", "collectives", *kept}, ran
    assert set(report["skipped"]) == {"torch backend", *skip}
    assert all(row["wrong"] == 0 for row in report["collectives"]["rows"])
    assert {run["strategy"] for run in report["training"]} == kept
    assert all(run["returncode"] == 0 and run["final_loss"] > 0 for run in report["training"])
