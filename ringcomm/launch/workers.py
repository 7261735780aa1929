"""The launcher's supervision: start every worker of a group, relay its output with a rank
prefix, notice the first failure, name the rank that caused it (from the workers' error
reports), stop the rest, and restart the group while restarts remain. The behaviour a user
sees is described in :mod:`ringcomm.launch`; how one worker's processes are started,
signalled and looked at is :mod:`.processes`.

>>> sys.exit(main(["--nproc", "2", "train.py"]))
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import secrets
import signal
import socket
import subprocess
import tempfile
import time

from .. import env, rundir
from ..errors import CommError
from . import rounds
from .config import LaunchConfig, free_port, log, parse_args, worker_env
from .processes import Worker, describe_exit, spawn

GRACE_PERIOD_S = 3.0
REPORT_WAIT_S = 1.5  # after a first failure, how long to wait for the others' reports
POLL_INTERVAL_S = 0.05
EXIT_FAILURE = 1
STOPPED = -1  # WorkerGroup.run: stopped because another node decided the round


class WorkerGroup:
    """One attempt: spawn ``nproc`` workers, watch them, stop them all."""

    def __init__(self, cfg: LaunchConfig, restart_count: int = 0):
        self.cfg = cfg
        self.restart_count = restart_count
        self.workers: list[Worker] = []
        self.lost: dict[int, int] = {}  # rank -> exit status, with --on-failure continue
        # where each worker writes what ended it (see ringcomm.world): private, removed by kill()
        self.reports = tempfile.mkdtemp(prefix="ringcomm-reports-")
        # chosen before any worker starts: a fallback one reaches them all (RINGCOMM_RUN_DIR);
        # if none can be, each worker says why
        with contextlib.suppress(CommError):
            rundir.path()

    def spawn_one(self, local_rank: int) -> None:
        cfg = self.cfg
        env = worker_env(cfg, local_rank, self.restart_count)
        env["RINGCOMM_ERROR_FILE"] = os.path.join(self.reports, f"rank-{env['RANK']}.json")
        worker = Worker(local_rank, int(env["RANK"]), spawn(cfg.command(), env, capture=cfg.prefix))
        self.workers.append(worker)  # before its readers start: kill() must reap it whatever follows
        if cfg.prefix:
            worker.relay_output()

    def run(self, interrupted, stop_requested=lambda: False) -> int:
        """Spawn and watch until all succeed (0), one fails (1), a signal arrives (128 +
        signum, as returned by ``interrupted()``) or ``stop_requested()`` says the round was
        decided on another node (``STOPPED``)."""
        for local_rank in range(self.cfg.nproc):
            if interrupted():
                break
            self.spawn_one(local_rank)
        while True:
            signum = interrupted()
            if signum:
                log(f"received {signal.Signals(signum).name}; stopping all workers")
                self.stop()
                return 128 + signum
            if stop_requested():
                self.stop()
                return STOPPED
            codes = [(w, w.proc.poll()) for w in self.workers]
            failed = [(w, rc) for w, rc in codes if rc not in (None, 0)]
            if failed and self.cfg.on_failure == "continue":
                self._report_lost(failed)
                if all(rc is not None for _, rc in codes):
                    self.stop()
                    return self._outcome(codes)
            elif failed:
                self._explain(failed)
                self.stop()
                return EXIT_FAILURE
            elif all(rc == 0 for _, rc in codes):
                self.stop()  # sweeps anything the workers left running
                return 0
            time.sleep(POLL_INTERVAL_S)

    def _report_lost(self, failed) -> None:
        """``--on-failure continue``: say once how each failed rank ended; the others go on."""
        for w, rc in failed:
            if w.rank in self.lost:
                continue
            self.lost[w.rank] = rc
            report = self._report(w)
            why = f": {report['type']}: {str(report.get('message'))[:400]}" if report else ""
            left = sum(x.proc.poll() is None for x in self.workers)
            log(f"rank {w.rank} (local rank {w.local_rank}, pid {w.proc.pid}) was lost: "
                f"{describe_exit(rc)}{why}; {left} rank(s) here go on (--on-failure continue)")

    def _outcome(self, codes) -> int:
        """``--on-failure continue``, every worker ended: 0 if some exited 0 and every other
        one was lost to a signal (killed, crashed); 1 if none survived, or one exited with
        an error of its own (which survivors cannot absorb)."""
        survivors = [w.rank for w, rc in codes if rc == 0]
        errors = [w.rank for w, rc in codes if rc is not None and rc > 0]
        log(f"every worker ended: {len(survivors)} of {len(codes)} exited 0; lost rank(s) "
            f"{sorted(self.lost)}")
        return 0 if survivors and not errors else EXIT_FAILURE

    def _report(self, worker: Worker):
        try:
            with open(os.path.join(self.reports, f"rank-{worker.rank}.json")) as f:
                report = json.load(f)
            return report if isinstance(report, dict) else None
        except (OSError, ValueError):
            return None

    def _explain(self, failed) -> None:
        """Say which ranks failed and why; name (and kill at once) a rank the others blame.

        The ranks a stopped or hung rank leaves behind fail within a second or so of each
        other: wait that long for their reports, so the one they name is the one reported."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers):
            time.sleep(POLL_INTERVAL_S)
        failed = [(w, w.proc.poll()) for w in self.workers if w.proc.poll() not in (None, 0)]
        reports = {w.rank: self._report(w) for w, _ in failed}
        blamed: dict[int, list[int]] = {}
        for rank, report in reports.items():
            culprit = report.get("blames") if report else None
            if isinstance(culprit, int) and culprit != rank:
                blamed.setdefault(culprit, []).append(rank)
        for w, rc in failed:
            report = reports[w.rank]
            why = f": {report['type']}: {str(report.get('message'))[:400]}" if report else ""
            victim = report and report.get("blames") in blamed and report.get("blames") != w.rank
            log(f"rank {w.rank} (local rank {w.local_rank}, pid {w.proc.pid}) "
                f"{'exited because of rank ' + str(report['blames']) if victim else 'failed'}: "
                f"{describe_exit(rc)}{why}")
        by_rank = {w.rank: w for w in self.workers}
        for culprit, namers in sorted(blamed.items()):
            worker = by_rank.get(culprit)
            running = worker is not None and worker.proc.poll() is None
            named = f"named by rank(s) {', '.join(map(str, sorted(namers)))}"
            causes = {reports[r].get("cause") for r in namers}
            if running and "not started" in causes and "silent" not in causes:
                log(f"rank {culprit} is alive but never started the collective its peers waited "
                    f"in ({named}): killing it now")
            elif running:
                log(f"rank {culprit} stopped answering its peers ({named}); it is still running, "
                    f"stopped or hung: killing it now")
            elif worker is None:
                log(f"rank {culprit}, on another node, failed its peers here ({named})")
            else:
                log(f"rank {culprit} was lost by its peers ({named}): "
                    f"{describe_exit(worker.proc.returncode)}")
            if running:
                worker.signal_group(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(timeout=2)

    def stop(self, grace: float = GRACE_PERIOD_S) -> None:
        """SIGTERM every live process group, SIGKILL after ``grace``, reap all."""
        running = [w for w in self.workers if w.proc.poll() is None]
        targets = [w for w in self.workers if w.group_alive()]
        if running:
            log(f"stopping rank(s) {', '.join(str(w.rank) for w in running)} "
                f"(SIGTERM, SIGKILL after {grace:g}s)")
        for w in targets:
            w.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while targets and time.monotonic() < deadline:
            targets = [w for w in targets if w.group_alive()]
            if targets:
                time.sleep(POLL_INTERVAL_S)
        if targets:
            log(f"rank(s) {', '.join(str(w.rank) for w in targets)} still running "
                f"after {grace:g}s; sending SIGKILL")
        self.kill()

    def kill(self) -> None:
        """SIGKILL every worker process group and reap; safe to call repeatedly."""
        for w in self.workers:
            if w.group_alive():
                w.signal_group(signal.SIGKILL)
        for w in self.workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log(f"rank {w.rank} (pid {w.proc.pid}) could not be reaped")
        deadline = time.monotonic() + 2.0  # readers end once the pipes close
        for w in self.workers:
            for thread in w.readers:
                thread.join(max(0.0, deadline - time.monotonic()))
        shutil.rmtree(self.reports, ignore_errors=True)
        rundir.remove_owned_by([w.proc.pid for w in self.workers])


class _SignalCatcher:
    """Records the first SIGINT/SIGTERM; the watch loop acts on it."""

    def __init__(self):
        self.received = 0
        self._previous = {}

    def __call__(self) -> int:
        return self.received

    def _handle(self, signum, frame):
        self.received = self.received or signum

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: cannot install handlers
                self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def run(cfg: LaunchConfig, interrupted=lambda: 0) -> int:
    """Run the job with restarts; returns the launcher's exit code."""
    if cfg.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        log("setting OMP_NUM_THREADS=1 for each worker to avoid overloading the "
            "host; set it yourself to tune performance")
    if cfg.nnodes > 1 and cfg.max_restarts > 0:
        return _run_rounds(cfg, interrupted)
    for attempt in range(cfg.max_restarts + 1):
        if attempt and cfg.auto_port:
            cfg = dataclasses.replace(cfg, master_port=free_port(cfg.master_addr))
        code = _attempt(cfg, attempt, interrupted)
        if code != EXIT_FAILURE:
            return code
        if attempt < cfg.max_restarts:
            log(f"restarting all workers (restart {attempt + 1} of {cfg.max_restarts})")
    if cfg.max_restarts:
        log(f"giving up after {cfg.max_restarts} restart(s)")
    return EXIT_FAILURE


def _attempt(cfg, attempt, interrupted, stop_requested=lambda: False):
    group = WorkerGroup(cfg, restart_count=attempt)
    atexit.register(group.kill)
    try:
        return group.run(interrupted, stop_requested)
    finally:
        group.kill()
        atexit.unregister(group.kill)


def _run_rounds(cfg, interrupted):
    """Several nodes with restarts: every round agreed with the other nodes' launchers
    (see :mod:`.rounds`); the workers meet on MASTER_PORT + 1."""
    join_timeout = cfg.timeout or env.timeout(os.environ)
    coordinator = agent = None
    rnd = 0
    try:
        if cfg.node_rank == 0:
            coordinator = _coordinator(cfg, join_timeout)
        agent = rounds.Agent(node=cfg.node_rank, addr=cfg.master_addr, port=cfg.master_port,
                             secret=cfg.secret, join_timeout=join_timeout)
        for rnd in itertools.count():
            code = _round(cfg, agent, rnd, interrupted)
            if code is not None:
                return code
    except BaseException as exc:
        if agent is not None:  # whoever still listens ends the job too (workers that could
            agent.report("quit", rnd)  # not start, a lost coordinator...)
        if not isinstance(exc, rounds.RoundsError):
            raise
        log(str(exc))
        return EXIT_FAILURE
    finally:
        if agent is not None:
            agent.close()
        if coordinator is not None:
            coordinator.close()


def _coordinator(cfg, join_timeout):
    """Node 0's coordinator of the rounds, on --master-addr:--master-port."""
    try:
        addr = socket.gethostbyname(cfg.master_addr)
    except OSError as exc:
        raise rounds.RoundsError(f"cannot resolve --master-addr {cfg.master_addr!r}: {exc}") from None
    return rounds.Coordinator(
        nnodes=cfg.nnodes, max_restarts=cfg.max_restarts, addr=addr, port=cfg.master_port,
        secret=cfg.secret, job=cfg.job_id or secrets.token_hex(8), worker_port=cfg.master_port + 1,
        join_timeout=join_timeout, log=log)


def _round(cfg, agent, rnd, interrupted):
    """Round ``rnd`` on this node: join it, run the workers, report, hear the verdict.
    Returns the launcher's exit code, or None when every node restarts."""
    go = agent.join(rnd, interrupted)
    if "signal" in go:
        return _quit(agent, rnd, go["signal"])
    if "verdict" in go:
        log(f"round {rnd} did not start: {go['why']}")
        return EXIT_FAILURE
    round_cfg = dataclasses.replace(cfg, master_port=go["port"], job_id=go["job"])
    code = _attempt(round_cfg, rnd, interrupted, lambda: agent.stop_requested(rnd))
    if code not in (0, EXIT_FAILURE, STOPPED):  # interrupted here: the job ends on every node
        return _quit(agent, rnd, code - 128)
    if code != STOPPED:
        agent.report("done" if code == 0 else "failed", rnd)
    verdict, why = agent.verdict(rnd, interrupted)
    if verdict is None or interrupted():  # a signal: the job ends, whatever was decided
        return _quit(agent, rnd, why if verdict is None else interrupted())
    if verdict == rounds.FINISHED:
        return 0
    if verdict != rounds.RESTART:
        log(f"{why}: giving up" + (f" after {rnd} restart(s)" if rnd else ""))
        return EXIT_FAILURE
    log(f"{why}: restarting the workers of every node (restart {rnd + 1} of {cfg.max_restarts})")
    return None


def _quit(agent, rnd, signum):
    """Interrupted by ``signum``: end the job on every node, then exit 128 + signum."""
    log(f"received {signal.Signals(signum).name}; ending the job on every node")
    agent.report("quit", rnd)
    # let the coordinator hear it before this launcher (maybe node 0's) goes
    with contextlib.suppress(rounds.RoundsError):
        agent.verdict(rnd, within=3.0)
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    catcher = _SignalCatcher()
    catcher.install()
    try:
        return run(cfg, catcher)
    finally:
        catcher.restore()

