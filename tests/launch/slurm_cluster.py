"""A one-machine SLURM cluster, stood up for a test and taken down after: munged (if none
runs), slurmctld and slurmd of Debian's slurm-wlm with a configuration in a temporary
folder, one node (this host) and one partition that oversubscribes its cores.

    python tests/launch/slurm_cluster.py [--ntasks 4]      # as root: srun -n N of the check

:func:`cluster` yields the environment that points ``srun`` at it; it raises
:class:`Unavailable` (the caller skips) when the daemons cannot be run here.
"""
import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ringcomm.env import free_port

DAEMONS = ("srun", "sinfo", "slurmctld", "slurmd", "munged", "munge", "unmunge")
MUNGED_PID = "/run/munge/munged.pid"


class Unavailable(Exception):
    """SLURM cannot be stood up here (not installed, not root, daemons that do not start)."""


def _config(folder, host):
    cpus = os.cpu_count() or 1
    return f"""ClusterName=ringcomm-test
SlurmctldHost={host}
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmctldPort={free_port("127.0.0.1")}
SlurmdPort={free_port("127.0.0.1")}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MessageTimeout=3
SlurmdParameters=config_overrides
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


def _munge_works():
    try:
        token = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        return token.returncode == 0 and subprocess.run(["unmunge"], input=token.stdout, capture_output=True,
                                                        timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _tail(path, lines=5):
    with contextlib.suppress(OSError), open(path) as f:
        return " | ".join(f.read().splitlines()[-lines:])
    return ""


def _start(cmd, env, what):
    """Run a daemon's start command; Unavailable, with why, if it fails."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{what} did not start: {exc}") from None
    if done.returncode:
        raise Unavailable(f"{what} did not start (exit {done.returncode}): {done.stderr.strip()[-300:]}")


def _stop(pid_file):
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(Path(pid_file).read_text()), 15)


@contextlib.contextmanager
def cluster():
    """The environment (``SLURM_CONF``) of a running one-machine cluster."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not found (apt-get install slurmd slurmctld slurm-client munge)")
    if os.geteuid() != 0:
        raise Unavailable("the one-machine SLURM runs its daemons as root")
    started = []  # pid files of what this call started
    folder = tempfile.mkdtemp(prefix="ringcomm-slurm-")
    try:
        if not _munge_works():
            os.makedirs("/run/munge", exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            _start(["munged", "--force"], None, "munged")
            started.append(MUNGED_PID)
            if not _munge_works():
                raise Unavailable("munged does not answer (see /var/log/munge)")
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(folder, sub))
        conf = os.path.join(folder, "slurm.conf")
        with open(conf, "w") as f:
            f.write(_config(folder, socket.gethostname()))
        # the tests' SLURM alone: a CI that itself runs inside a SLURM job must not leak into it
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = conf
        for daemon in ("slurmctld", "slurmd"):
            started.append(os.path.join(folder, f"{daemon}.pid"))
            _start([daemon, "-f", conf], env, daemon)
        deadline = time.monotonic() + 30
        while True:
            try:  # with MessageTimeout=3 a dead controller answers within the timeout
                state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True,
                                       timeout=10).stdout.strip()
            except subprocess.TimeoutExpired:
                state = "no answer"
            if state == "idle":
                break
            if time.monotonic() > deadline:
                raise Unavailable(f"the node did not come up (sinfo: {state!r}); slurmctld: "
                                  f"{_tail(os.path.join(folder, 'slurmctld.log'))}; slurmd: "
                                  f"{_tail(os.path.join(folder, 'slurmd.log'))}")
            time.sleep(0.5)
        yield env
    finally:
        for pid_file in reversed(started):
            _stop(pid_file)
        time.sleep(0.5)
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ntasks", type=int, default=4)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_real_launchers import CHECK
    with tempfile.TemporaryDirectory() as out, cluster() as env:
        script = os.path.join(out, "check.py")
        with open(script, "w") as f:
            f.write(CHECK)
        port = free_port("127.0.0.1")
        done = subprocess.run(["srun", "-n", str(args.ntasks), "-O",
                               f"--export=ALL,MASTER_ADDR=127.0.0.1,MASTER_PORT={port},OMP_NUM_THREADS=1",
                               sys.executable, script, out], env=env, timeout=120)
        for name in sorted(n for n in os.listdir(out) if n.startswith("rank")):
            print(Path(out, name).read_text())
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
