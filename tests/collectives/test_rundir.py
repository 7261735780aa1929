"""The private run directory when another user made it first, or others may open it: the
job still starts, in a directory of this user's that every rank agrees on, and nothing of
the other directory is used or removed."""
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from harness import spawn_job
from ringcomm import rundir

pytestmark = pytest.mark.timeout(90)
STRANGER = 65534  # nobody

# no RINGCOMM_SECRET: the ranks share a fresh one through the run directory, so they must
# agree on it; each prints where its ipc socket and its run directory are
JOB = """
import os, numpy as np, ringcomm
from ringcomm import rundir
comm = ringcomm.init()
x = np.full(4, comm.rank + 1.0)
comm.all_reduce(x)
ipc = comm._engine.session.wire.bound["ipc"][len("ipc://"):]
print("sum", x[0], "ipc", os.path.dirname(ipc), "run", rundir.path(), flush=True)
comm.close()
"""


def dead_pid():
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)


def given_away(directory):
    """``directory``, made as another user's, holding a socket file of a process that is gone
    (this user's clean-up would remove it, were the directory used)."""
    directory.mkdir(mode=0o700)
    left = directory / f"{rundir.owner(dead_pid())}-deadbeef.sock"
    left.touch()
    os.chown(left, STRANGER, STRANGER)
    os.chown(directory, STRANGER, STRANGER)
    return left


@pytest.fixture
def tmp():
    """A fresh temporary directory (sticky and open to all, as /tmp) for the job's TMPDIR,
    with a short path (an ipc socket's path has at most 107 bytes)."""
    if os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    parent = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
    os.chmod(parent, 0o1777)
    yield parent
    shutil.rmtree(parent)


def job_env(tmp):
    return {"TMPDIR": str(tmp), "XDG_RUNTIME_DIR": "", "RINGCOMM_RUN_DIR": "", "RINGCOMM_SECRET": ""}


def private(directory):
    info = os.lstat(directory)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700


def untouched(foreign, left):
    info = os.lstat(foreign)
    return info.st_uid == STRANGER and os.listdir(foreign) == [left.name]


def where(results):
    """The one run directory every rank used (for its socket and its secret file)."""
    dirs, n = set(), len(results)
    for code, out, err in results:
        assert code == 0 and f"sum {n * (n + 1) / 2}" in out, err
        words = out.split()
        dirs |= {words[words.index("ipc") + 1], words[words.index("run") + 1]}
    assert len(dirs) == 1, dirs
    return dirs.pop()


def test_a_job_starts_when_another_user_owns_the_run_directory(tmp):
    foreign = tmp / f"ringcomm-{os.getuid()}"
    left = given_away(foreign)
    results = spawn_job(JOB, 3, env=job_env(tmp), timeout=60)
    used = where(results)
    assert used == f"{foreign}-1" and private(used)
    assert untouched(foreign, left)
    assert all(f"{foreign} is not usable (owned by uid {STRANGER})" in err for _, _, err in results)
    assert not [n for n in os.listdir(used) if n.startswith("secret-")]  # removed once all joined


def test_the_launcher_passes_a_fresh_directory_to_its_workers(tmp, tmp_path):
    """Every predictable name taken: the launcher makes an unpredictable one and its workers
    use it too (RINGCOMM_RUN_DIR), which is where it cleans up after them."""
    foreign = tmp / f"ringcomm-{os.getuid()}"
    taken = [(d, given_away(d)) for d in [foreign] + [tmp / f"{foreign.name}-{n}" for n in range(1, 5)]]
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, **job_env(tmp), PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", "2", "--timeout", "30",
                             str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split("]: ", 1)[1] for line in result.stdout.splitlines() if "sum" in line]
    used = where([(0, line, result.stderr) for line in lines])
    assert len(lines) == 2 and os.path.dirname(used) == str(tmp) and private(used)
    assert os.path.basename(used).startswith(f"{foreign.name}-") and used not in {str(d) for d, _ in taken}
    assert os.listdir(used) == []  # the workers' sockets are gone with them
    assert all(untouched(d, left) for d, left in taken)


def test_a_run_directory_others_can_open_is_left_for_another(tmp_path, monkeypatch, caplog):
    runtime = tmp_path / "run"
    (runtime / "ringcomm").mkdir(parents=True)
    os.chmod(runtime / "ringcomm", 0o755)
    (runtime / "ringcomm" / "planted").touch()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("RINGCOMM_RUN_DIR", "")  # the choice below is set here; undone after
    with caplog.at_level(logging.WARNING, logger="ringcomm.rundir"):
        chosen = rundir.path()
    assert chosen == str(runtime / "ringcomm-1") and private(chosen)
    assert "mode 755 lets others in" in caplog.text and chosen in caplog.text
    assert rundir.path() == chosen == os.environ["RINGCOMM_RUN_DIR"]  # kept by this process
    assert os.listdir(runtime / "ringcomm") == ["planted"]
