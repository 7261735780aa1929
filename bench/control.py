"""How bench/peers.py drives several libraries' jobs in one run, one call block at a time.

Every rank of every library's job (ringcomm under its launcher, torch.distributed Gloo
ranks, Open MPI ranks under mpirun) connects to the driver's TCP socket on 127.0.0.1, says
hello, and then waits in a plain blocking socket read, so that an idle library uses no CPU
(an MPI rank waiting in MPI_Barrier would spin). The driver sends every rank of one library
the same command, one JSON object per line:

    {"cmd": "run", "size": 4194304, "warmup": 1, "iters": 10, "algorithm": "ring"}
    {"cmd": "quit"}

and each rank answers ``{"times": [seconds per timed call], "wrong": n, "block_s": s}`` or
``{"error": "traceback"}``. A run times float32 SUM all-reduces: before each call the
buffer is reset to rank r's input (benchlib.input_for), the library's own barrier runs,
then the timed call; every result (warm-up included) is checked against the closed form.
The per-call time of the block is the maximum over ranks, taken by the driver.
"""
import json
import os
import signal
import socket
import subprocess
import time
import traceback

import numpy as np

import benchlib as bl

HELLO_TIMEOUT_S = 120.0


# -- worker side -----------------------------------------------------------------------------
def serve(address, library, rank, world_size, barrier, all_reduce, version=""):
    """Answer the driver's commands until "quit". ``all_reduce(x, algorithm)`` works in place
    on a float32 numpy array; ``barrier()`` is the library's own."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=HELLO_TIMEOUT_S)
    sock.settimeout(None)
    stream = sock.makefile("rwb")

    def reply(obj):
        stream.write(json.dumps(obj).encode() + b"\n")
        stream.flush()

    reply({"hello": library, "rank": rank, "world_size": world_size, "version": version,
           "pid": os.getpid()})
    buffers = {}  # size -> (x, input, expected), reused across rounds like a gradient buffer
    for line in stream:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            count = cmd["size"] // 4
            if count not in buffers:
                base = bl.input_for(rank, count, np.float32)
                buffers[count] = (base.copy(), base, bl.reduced(world_size, count, np.float32))
            x, base, want = buffers[count]
            times, wrong, block = [], 0, time.perf_counter()
            for i in range(cmd["warmup"] + cmd["iters"]):
                np.copyto(x, base)
                barrier()
                start = time.perf_counter()
                all_reduce(x, cmd.get("algorithm"))
                elapsed = time.perf_counter() - start
                if i >= cmd["warmup"]:
                    times.append(elapsed)
                wrong += bl.count_wrong(x, want)
            reply({"times": times, "wrong": wrong, "block_s": time.perf_counter() - block})
        except Exception:  # noqa: BLE001 - the driver reports it and stops this library
            reply({"error": traceback.format_exc()})
    stream.close()
    sock.close()


# -- driver side -----------------------------------------------------------------------------
class Job:
    """One library's job of ``n`` ranks: its processes and one control connection per rank."""

    def __init__(self, name, n, log_path):
        self.name, self.n, self.log_path = name, n, log_path
        self.procs, self.conns, self.version, self.error = [], {}, "", None

    def start(self, argv, env=None):
        """Start one process of this job in its own session, output to the log file."""
        with open(self.log_path, "ab") as log:
            self.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))

    def accept(self, listener, timeout=HELLO_TIMEOUT_S):
        """Wait until all n ranks said hello; None (and self.error) if the job died first."""
        deadline = time.monotonic() + timeout
        listener.settimeout(0.5)
        while len(self.conns) < self.n:
            if time.monotonic() > deadline:
                return self.fail(f"only {len(self.conns)} of {self.n} ranks connected in {timeout:g} s")
            dead = [p for p in self.procs if p.poll() not in (None, 0)]
            if dead:
                return self.fail(f"exited with code {dead[0].returncode} before all ranks connected")
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(timeout)
            stream = conn.makefile("rwb")
            hello = json.loads(stream.readline())
            if hello.get("hello") != self.name:
                conn.close()  # another job's late straggler: not ours
                continue
            self.conns[hello["rank"]] = (conn, stream)
            self.version = hello.get("version", "")
        return True

    def run(self, command, timeout):
        """Send ``command`` to every rank; return the replies in rank order, or None."""
        if self.error:
            return None
        try:
            for conn, stream in self.conns.values():
                conn.settimeout(timeout)
                stream.write(json.dumps(command).encode() + b"\n")
                stream.flush()
            replies = [json.loads(self.conns[r][1].readline() or b"null") for r in range(self.n)]
        except (OSError, ValueError) as exc:
            return self.fail(f"no answer to {command}: {exc}")
        for rank, reply in enumerate(replies):
            if reply is None or "error" in reply:
                return self.fail(f"rank {rank} failed on {command}: "
                                 f"{reply['error'] if reply else 'connection closed'}")
        return replies

    def fail(self, message):
        """Record why this job cannot go on and stop it; returns None (a failed answer)."""
        self.error = message + f" (log: {self.log_path})"
        self.stop()

    def stop(self, grace=10.0):
        """Ask every rank to quit, then terminate whatever of this job is still running."""
        for conn, stream in self.conns.values():
            try:
                stream.write(b'{"cmd": "quit"}\n')
                stream.flush()
                conn.close()
            except OSError:
                pass
        self.conns = {}
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                        proc.wait(3)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
        return self.error is None
