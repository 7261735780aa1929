"""Tests for ringcomm.launch with real worker processes.

Worker scripts are tiny files in tmp_path: they only read env vars, print,
sleep and exit (no ringcomm.comm), so these tests exercise the launcher alone.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ringcomm.launch import config, workers  # noqa: E402

SCRUBBED = ("MASTER_ADDR", "MASTER_PORT", "RINGCOMM_SECRET", "RINGCOMM_TIMEOUT",
            "OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE",
            "TORCHELASTIC_RESTART_COUNT", "RINGCOMM_RESTART_COUNT", "RINGCOMM_SECRET_FILE",
            "RINGCOMM_INSECURE", "RINGCOMM_JOB_ID")
LINE = re.compile(r"^\[rank (\d+)\]: (.*)$")


def _env(extra_path=None, **overrides):
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    paths = [str(REPO)] + ([str(extra_path)] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(overrides)
    return env


def run_launcher(*args, timeout=30, extra_path=None, **env_overrides):
    return subprocess.run([sys.executable, "-m", "ringcomm.launch", *map(str, args)],
                          cwd=REPO, env=_env(extra_path, **env_overrides),
                          capture_output=True, text=True, timeout=timeout)


def write_script(tmp_path: Path, body: str, name: str = "worker.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def by_rank(output: str) -> dict[int, dict[str, str]]:
    """Parse ``[rank R]: KEY=VALUE`` lines into {rank: {KEY: VALUE}}."""
    result: dict[int, dict[str, str]] = {}
    for line in output.splitlines():
        match = LINE.match(line)
        if match and "=" in match.group(2):
            key, _, value = match.group(2).partition("=")
            result.setdefault(int(match.group(1)), {})[key] = value
    return result


def pid_gone(pid: int) -> bool:
    """True if the process does not exist (or is only a zombie nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def wait_for_files(paths, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() and p.read_text().strip() for p in paths):
            return [int(p.read_text()) for p in paths]
        time.sleep(0.05)
    raise AssertionError(f"workers did not write {paths} in {timeout}s")


PRINT_ENV = """
import os
for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "RINGCOMM_SECRET",
            "TORCHELASTIC_RESTART_COUNT", "PYTHONUNBUFFERED", "RINGCOMM_TIMEOUT"):
    print(f"{key}={os.environ.get(key, '<unset>')}")
"""

# Sets itself up (ignore SIGTERM, start a grandchild) and then writes its pid
# to pid<RANK>; rank FAIL_RANK waits for all pid files, then fails as told by
# FAIL_HOW (an exit code, or "kill"); everyone else sleeps 60 s.
SLEEP_OR_FAIL = """
import os, signal, subprocess, sys, time
from pathlib import Path

def publish(name, pid):
    (d / f"{name}.tmp").write_text(str(pid))
    (d / f"{name}.tmp").rename(d / name)

d = Path(sys.argv[1]); rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
how = os.environ.get("FAIL_HOW", "")
if how and rank == int(os.environ["FAIL_RANK"]):
    publish(f"pid{rank}", os.getpid())
    deadline = time.time() + 15
    while time.time() < deadline and not all((d / f"pid{r}").exists() for r in range(world)):
        time.sleep(0.02)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ.get("GRANDCHILD") and rank == 0:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    publish("grandchild", child.pid)
publish(f"pid{rank}", os.getpid())
print("sleeping", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_env_vars_for_three_workers(tmp_path):
    script = write_script(tmp_path, PRINT_ENV)
    res = run_launcher("--nproc", 3, "--timeout", 12.5, script)
    assert res.returncode == 0, res.stderr
    envs = by_rank(res.stdout)
    assert sorted(envs) == [0, 1, 2]
    secrets = {e["RINGCOMM_SECRET"] for e in envs.values()}
    assert len(secrets) == 1 and re.fullmatch(r"[0-9a-f]{32}", secrets.pop())
    ports = {e["MASTER_PORT"] for e in envs.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for rank, e in envs.items():
        assert e["RANK"] == e["LOCAL_RANK"] == str(rank)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "3"
        assert e["GROUP_RANK"] == "0" and e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["OMP_NUM_THREADS"] == "1" and e["PYTHONUNBUFFERED"] == "1"
        assert e["RINGCOMM_TIMEOUT"] == "12.5"
    assert "OMP_NUM_THREADS" in res.stderr  # the one-line note


@pytest.mark.timeout(60)
def test_user_settings_are_passed_through(tmp_path):
    script = write_script(tmp_path, PRINT_ENV)
    res = run_launcher("--nproc_per_node=2", "--master_addr", "localhost", script,
                       MASTER_PORT="23456", RINGCOMM_SECRET="s3cret", OMP_NUM_THREADS="4")
    assert res.returncode == 0, res.stderr
    envs = by_rank(res.stdout)
    assert sorted(envs) == [0, 1]
    for e in envs.values():
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("localhost", "23456")
        assert e["RINGCOMM_SECRET"] == "s3cret" and e["OMP_NUM_THREADS"] == "4"
        assert e["RINGCOMM_TIMEOUT"] == "<unset>"


@pytest.mark.timeout(60)
def test_multinode_ranks(tmp_path):
    script = write_script(tmp_path, PRINT_ENV)
    refused = run_launcher("--nnodes", 2, "--node-rank", 1, "--nproc", 2, script)
    assert refused.returncode == 2 and "RINGCOMM_SECRET_FILE" in refused.stderr
    res = run_launcher("--nnodes", 2, "--node-rank", 1, "--nproc", 2, script, RINGCOMM_INSECURE="1")
    assert res.returncode == 0, res.stderr
    envs = by_rank(res.stdout)
    assert sorted(envs) == [2, 3]
    assert [envs[r]["LOCAL_RANK"] for r in (2, 3)] == ["0", "1"]
    for e in envs.values():
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2"
        assert e["GROUP_RANK"] == "1" and e["MASTER_PORT"] == "29500"
    assert "RINGCOMM_INSECURE=1" in res.stderr  # warning: anyone can compute this secret
    assert len({e["RINGCOMM_SECRET"] for e in envs.values()}) == 1


@pytest.mark.timeout(60)
def test_script_args_pass_through(tmp_path):
    script = write_script(tmp_path, "import sys\nprint('ARGS=' + repr(sys.argv[1:]))\n")
    res = run_launcher("--nproc", 2, script, "--lr", "0.1", "--foo", "--nproc", "7", "--", "-m", "x")
    assert res.returncode == 0, res.stderr
    expected = repr(["--lr", "0.1", "--foo", "--nproc", "7", "--", "-m", "x"])
    assert {r: e["ARGS"] for r, e in by_rank(res.stdout).items()} == {0: expected, 1: expected}


@pytest.mark.timeout(60)
def test_module_with_args(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text("import os, sys\nprint(f'MOD={os.environ[\"RANK\"]}:{sys.argv[1:]}')\n")
    res = run_launcher("--nproc", 2, "-m", "mypkg.job", "--lr", "0.1", extra_path=tmp_path)
    assert res.returncode == 0, res.stderr
    assert by_rank(res.stdout) == {r: {"MOD": f"{r}:['--lr', '0.1']"} for r in (0, 1)}


@pytest.mark.timeout(60)
def test_all_succeed_exit_zero(tmp_path):
    script = write_script(tmp_path, "print('done')\n")
    res = run_launcher("--nproc", 2, script)
    assert res.returncode == 0, res.stderr
    assert "failed" not in res.stderr


@pytest.mark.timeout(60)
def test_failure_stops_the_others(tmp_path):
    script = write_script(tmp_path, SLEEP_OR_FAIL)
    start = time.monotonic()
    res = run_launcher("--nproc", 3, script, tmp_path, FAIL_RANK="1", FAIL_HOW="3", GRANDCHILD="1")
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr
    assert elapsed < 15, elapsed
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) failed: exit code 3", res.stderr), res.stderr
    assert re.search(r"stopping rank\(s\) 0, 2", res.stderr), res.stderr
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    for pid in pids:  # direct workers were reaped by the launcher
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    grandchild = int((tmp_path / "grandchild").read_text())
    deadline = time.monotonic() + 5  # killed with its process group; reaped by init
    while not pid_gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid_gone(grandchild)


@pytest.mark.timeout(60)
def test_worker_killed_by_signal(tmp_path):
    script = write_script(tmp_path, SLEEP_OR_FAIL)
    res = run_launcher("--nproc", 2, script, tmp_path, FAIL_RANK="0", FAIL_HOW="kill")
    assert res.returncode == 1, res.stderr
    assert re.search(r"rank 0 \(local rank 0, pid \d+\) failed: killed by signal 9 \(SIGKILL\)",
                     res.stderr), res.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid1").read_text()), 0)


@pytest.mark.timeout(60)
def test_sigterm_ignored_gets_sigkill_after_grace(tmp_path):
    script = write_script(tmp_path, SLEEP_OR_FAIL)
    start = time.monotonic()
    res = run_launcher("--nproc", 2, script, tmp_path, FAIL_RANK="1", FAIL_HOW="2", IGNORE_TERM="1")
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr
    assert workers.GRACE_PERIOD_S <= elapsed < 15, elapsed
    assert "sending SIGKILL" in res.stderr, res.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid0").read_text()), 0)


FLAKY = """
import os, sys
n = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
assert os.environ["RINGCOMM_RESTART_COUNT"] == str(n)
print(f"ATTEMPT={n}")
sys.exit(1 if n < 2 and os.environ["RANK"] == "0" else 0)
"""


@pytest.mark.timeout(60)
def test_restarts_until_success(tmp_path):
    script = write_script(tmp_path, FLAKY)
    res = run_launcher("--nproc", 2, "--max-restarts", 2, script)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("restarting all workers") == 2
    assert "[rank 0]: ATTEMPT=2" in res.stdout


@pytest.mark.timeout(60)
def test_restarts_exhausted(tmp_path):
    script = write_script(tmp_path, FLAKY)
    res = run_launcher("--nproc", 2, "--max_restarts", 1, script)
    assert res.returncode == 1, res.stderr
    assert "[rank 0]: ATTEMPT=1" in res.stdout and "ATTEMPT=2" not in res.stdout
    assert "giving up" in res.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_stops_workers(tmp_path, signum, code):
    script = write_script(tmp_path, SLEEP_OR_FAIL)
    proc = subprocess.Popen([sys.executable, "-m", "ringcomm.launch", "--nproc", "2",
                             str(script), str(tmp_path)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = wait_for_files([tmp_path / "pid0", tmp_path / "pid1"])
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert signal.Signals(signum).name in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(60)
def test_output_prefix_and_partial_line(tmp_path):
    script = write_script(tmp_path, """
        import sys
        print("hello")
        print("warn", file=sys.stderr)
        sys.stdout.write("tail without newline")
    """)
    res = run_launcher("--nproc", 2, script)
    assert res.returncode == 0, res.stderr
    for r in (0, 1):
        assert f"[rank {r}]: hello\n" in res.stdout
        assert f"[rank {r}]: tail without newline\n" in res.stdout
        assert f"[rank {r}]: warn\n" in res.stderr
    assert all(LINE.match(line) for line in res.stdout.splitlines())

    res = run_launcher("--no-prefix", script)
    assert res.returncode == 0 and res.stdout == "hello\ntail without newline"


def test_parse_defaults_to_the_main_job(monkeypatch):
    for key in SCRUBBED:
        monkeypatch.delenv(key, raising=False)
    cfg = config.parse_args(["--nproc", "2"])
    assert cfg.module == config.DEFAULT_MODULE == "ringcomm.train"
    assert cfg.script is None and cfg.args == ["--main-job"] and cfg.auto_port
    assert cfg.command()[-3:] == ["-m", "ringcomm.train", "--main-job"]
    env = config.worker_env(cfg, 1, restart_count=3, base_env={})
    assert env["RANK"] == "1" and env["RINGCOMM_RESTART_COUNT"] == "3"


def test_multinode_secret_is_deterministic_only_when_insecure(monkeypatch, tmp_path, capsys):
    for key in SCRUBBED:
        monkeypatch.delenv(key, raising=False)
    argv = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "1234"]
    with pytest.raises(SystemExit):
        config.parse_args(argv)
    assert "RINGCOMM_SECRET" in capsys.readouterr().err
    (tmp_path / "s").write_text("from-a-file\n")
    monkeypatch.setenv("RINGCOMM_SECRET_FILE", str(tmp_path / "s"))
    assert config.parse_args(argv).secret == "from-a-file"
    monkeypatch.delenv("RINGCOMM_SECRET_FILE")
    monkeypatch.setenv("RINGCOMM_INSECURE", "1")
    argv = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "1234"]
    a, b = config.parse_args(argv), config.parse_args(argv)
    assert a.secret == b.secret and len(a.secret) == 32
    assert config.parse_args(argv[:-1] + ["1235"]).secret != a.secret


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-3"])
def test_timeout_must_be_finite_and_positive(value, capsys):
    with pytest.raises(SystemExit) as exc:
        config.parse_args(["--nproc", "2", "--timeout", value])
    assert exc.value.code == 2
    assert "--timeout must be a finite number of seconds > 0" in capsys.readouterr().err


def test_workers_do_not_outlive_a_sigkilled_launcher(tmp_path):
    """The launcher cannot clean up after SIGKILL; the kernel's parent-death signal ends its
    workers (a worker that ignores SIGTERM too) within a second."""
    script = write_script(tmp_path, """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(sys.argv[1] + os.environ["RANK"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "ringcomm.launch", "--nproc", "2", str(script),
                             str(tmp_path / "pid")], cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        pids = wait_for_files([tmp_path / "pid0", tmp_path / "pid1"])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not all(pid_gone(p) for p in pids):
            time.sleep(0.02)
        assert all(pid_gone(p) for p in pids), "workers outlived their launcher"
    finally:
        proc.kill()
        for p in locals().get("pids", []):
            if not pid_gone(p):
                os.kill(p, signal.SIGKILL)


STOPS = """
import os, signal, time, numpy as np, ringcomm
comm = ringcomm.init()
x = np.ones(1000)
comm.all_reduce(x)
if comm.rank == 1:
    print(f"stopping at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    comm.all_reduce(x)
except ringcomm.CommError:
    print(f"failed at {time.time():.3f}", flush=True)
    raise
"""


@pytest.mark.timeout(60)
def test_launcher_names_a_stopped_rank_and_ends_within_the_deadline(tmp_path):
    """Rank 1 stops (SIGSTOP) between collectives, --timeout 3: ranks 0 and 2 fail within
    the deadline and the liveness check, the launcher reports them as its victims, names
    rank 1, and the job is over within the deadline + 5 s on an idle machine (on a loaded
    one the teardown, processes exiting and the launcher's wait for their reports, takes
    longer: bounded here by the deadline + 15 s)."""
    script = write_script(tmp_path, STOPS)
    res = run_launcher("--nproc", 3, "--timeout", 3, script, timeout=50)
    ended = time.time()
    assert res.returncode == 1, res.stderr
    assert "rank 1 stopped answering its peers (named by rank(s) 0, 2)" in res.stderr, res.stderr
    for rank in (0, 2):
        assert f"rank {rank} (local rank {rank}, pid" in res.stderr
        assert re.search(rf"rank {rank} \(local rank {rank}, pid \d+\) exited because of rank 1: "
                         r"exit code 1: CommTimeout", res.stderr), res.stderr
    assert "rank 1 (local rank 1" not in res.stderr  # the stopped rank is not reported as failed
    stopped = float(re.search(r"stopping at ([\d.]+)", res.stdout).group(1))
    failed = [float(t) for t in re.findall(r"failed at ([\d.]+)", res.stdout)]
    assert len(failed) == 2 and max(failed) - stopped < 3 + 3, (failed, stopped, res.stderr)
    assert ended - stopped < 3 + 15, res.stderr


BUSY = """
import time, numpy as np, ringcomm
comm = ringcomm.init()
x = np.ones(1000)
comm.all_reduce(x)
if comm.rank == 1:
    time.sleep(60)  # alive and answering liveness checks, but not in the collective
comm.all_reduce(x)
"""


@pytest.mark.timeout(60)
def test_launcher_names_a_rank_that_never_started_the_collective(tmp_path):
    """Rank 1 is busy elsewhere (its communication thread answers): the victims' reports say
    why (CommTimeout.cause), and the launcher names rank 1 as alive but absent, not hung."""
    script = write_script(tmp_path, BUSY)
    res = run_launcher("--nproc", 3, "--timeout", 2, script, timeout=50)
    assert res.returncode == 1, res.stderr
    assert "rank 1 is alive but never started the collective its peers waited in (named by rank(s) 0, 2)" \
        in res.stderr, res.stderr
    assert "stopped answering its peers" not in res.stderr


LEAVES_A_SOCKET = """
import os, signal, ringcomm
comm = ringcomm.init()
print("socket", comm._engine.session.wire.bound["ipc"][len("ipc://"):], flush=True)
comm.barrier()
if comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
comm.barrier()
"""


@pytest.mark.timeout(60)
def test_the_launcher_removes_the_sockets_of_killed_workers(tmp_path):
    script = write_script(tmp_path, LEAVES_A_SOCKET)
    res = run_launcher("--nproc", 2, "--timeout", 5, script, timeout=50)
    assert res.returncode == 1
    paths = re.findall(r"socket (\S+)", res.stdout)
    assert len(paths) == 2, res.stdout
    for path in paths:
        assert not os.path.exists(path), path
    assert "rank 1 stopped answering" not in res.stderr  # killed, not stopped
    assert re.search(r"rank 0 \(local rank 0, pid \d+\) exited because of rank 1: exit code 1: PeerLost", res.stderr), res.stderr
