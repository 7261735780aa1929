"""Run a function on N ranks: real processes, real ZeroMQ sockets, each rank's traceback back.

A :class:`RankPool` forks N worker processes once; each joins a ringcomm job with
``ringcomm.init()`` and then runs the functions it is sent, one at a time, returning each
result (or its traceback) over a pipe to the test process. Reusing the processes keeps a
large test matrix fast on two cores; a pool whose ranks failed or hung is killed and
replaced, so one broken test cannot spill into the next.

>>> pool = RankPool(4)
>>> results = pool.run(lambda_free_function, arg)     # one result per rank, rank order
"""
import contextlib
import multiprocessing as mp
import os
import signal
import traceback
from multiprocessing.connection import wait

from ringcomm import env

TEST_TIMEOUT = 20.0  # ringcomm's own deadline inside pools: a hang fails fast


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's story."""


def free_port():
    return env.free_port("127.0.0.1")


def job_env(rank, world_size, port, extra=None):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RINGCOMM_SECRET": "0" * 32,
           "RINGCOMM_TIMEOUT": str(TEST_TIMEOUT), "OMP_NUM_THREADS": "1"}
    env.update(extra or {})
    return env


def _serve(env, conn):
    os.environ.update(env)
    if env.get("TEST_SOFT_NOFILE"):  # start as a low default limit would (ringcomm raises it)
        import resource
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(env["TEST_SOFT_NOFILE"]), hard))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the test process
    try:
        import ringcomm
        comm = ringcomm.init()
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        if request is None:
            break
        fn, args, kwargs = request
        try:
            conn.send(("ok", fn(comm, *args, **kwargs)))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
    comm.close()
    os._exit(0)  # skip the test process's atexit handlers inherited through fork


class RankPool:
    def __init__(self, world_size, env=None, timeout=60.0):
        self.world_size = world_size
        port = free_port()
        ctx = mp.get_context("fork")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(job_env(rank, world_size, port, env), child),
                               daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect(timeout, "start-up")
        self.broken = False

    def run(self, fn, *args, timeout=60.0, **kwargs):
        """``fn(comm, *args, **kwargs)`` on every rank; the list of results in rank order."""
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, fn.__name__)

    def _collect(self, timeout, what):
        import time
        deadline = time.monotonic() + timeout
        results, pending = {}, dict(enumerate(self.conns))
        while pending and time.monotonic() < deadline:
            ready = wait(list(pending.values()) + [p.sentinel for p in self.procs],
                         deadline - time.monotonic())
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        results[rank] = conn.recv()
                    except EOFError:
                        results[rank] = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})")
                    del pending[rank]
                elif self.procs[rank].sentinel in ready and not conn.poll():
                    results[rank] = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})")
                    del pending[rank]
        for rank in pending:
            results[rank] = ("error", f"rank {rank} did not finish {what} within {timeout}s")
        failed = {r: v for r, (status, v) in results.items() if status == "error"}
        if failed:
            self.broken = True
            self.kill()
            story = "\n".join(f"--- rank {r} ---\n{failed[r]}" for r in sorted(failed))
            raise RankFailure(f"{what} failed on ranks {sorted(failed)}:\n{story}")
        return [results[r][1] for r in range(self.world_size)]

    def close(self):
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
        self.kill()

    def kill(self):
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def spawn_job(script, world_size, env=None, timeout=60.0):
    """Run ``script`` (Python source) as ``world_size`` fresh ranks; [(returncode, stdout,
    stderr)] in rank order. Every rank is killed at ``timeout``."""
    import subprocess
    import sys
    import time
    port = free_port()
    procs = []
    for rank in range(world_size):
        child_env = dict(os.environ, PYTHONUNBUFFERED="1", **job_env(rank, world_size, port, env))
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=child_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
            err += f"\n[harness: killed after {timeout}s]"
        results.append((proc.returncode, out, err))
    return results


def job_outputs(script, world_size, env=None, timeout=60.0):
    """What each rank of ``spawn_job(script, ...)`` printed, once every rank exited with 0
    (else an assertion naming the first rank that did not, with its stderr's tail)."""
    results = spawn_job(script, world_size, env=env, timeout=timeout)
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {rank}: exit {code}: {err[-3000:]}"
    return [out for _, out, _ in results]


def refusals(calls):
    """``{name: the exception's type name, or None}`` for each misuse ``calls[name]()``, which
    must raise TypeError or ValueError (anything else fails the test)."""
    raised = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = None
        except (TypeError, ValueError) as exc:
            raised[name] = type(exc).__name__
    return raised
