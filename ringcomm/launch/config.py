"""What ``python -m ringcomm.launch`` starts: its command line (torchrun's flags, parsed into a
:class:`LaunchConfig`) and the environment of each worker. Also the launcher's own output
(``log``), which the supervision in :mod:`.workers` and :mod:`.processes` shares.

>>> cfg = parse_args(["--nproc", "2", "-m", "mypkg.train", "--lr", "0.1"], environ={})
>>> worker_env(cfg, local_rank=1)["RANK"]                    # '1'
"""
from __future__ import annotations

import argparse
import math
import os
import secrets
import sys
import threading
from dataclasses import dataclass, field

from .. import secret as job_secret
from ..env import free_port

DEFAULT_MODULE = "ringcomm.train"
DEFAULT_ARGS = ("--main-job",)
DEFAULT_MULTINODE_PORT = 29500
PROG = "ringcomm.launch"

_stdout_lock = threading.Lock()
_stderr_lock = threading.Lock()


def _write(stream, lock: threading.Lock, data: bytes) -> None:
    """Write bytes to a text stream (or its binary buffer) and flush, under lock."""
    with lock:
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode("utf-8", errors="replace"))
                stream.flush()
        except (OSError, ValueError):
            pass  # our own output is gone (closed pipe); keep draining workers


def log(message: str) -> None:
    """Launcher messages: one line on stderr, prefixed with the program name."""
    _write(sys.stderr, _stderr_lock, f"{PROG}: {message}\n".encode())


@dataclass
class LaunchConfig:
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MULTINODE_PORT
    auto_port: bool = False  # port was picked here: pick a fresh one per restart
    max_restarts: int = 0
    timeout: float | None = None
    device: str | None = None
    on_failure: str = "stop"  # or "continue": a failed worker does not stop the others
    prefix: bool = True
    script: str | None = None
    module: str | None = DEFAULT_MODULE
    args: list[str] = field(default_factory=list)
    secret: str = ""
    job_id: str = ""  # names this launch at the rendezvous (RINGCOMM_JOB_ID)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    def command(self) -> list[str]:
        if self.module is not None:
            return [sys.executable, "-u", "-m", self.module, *self.args]
        return [sys.executable, "-u", self.script, *self.args]


def _build_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}", allow_abbrev=False,
        usage="%(prog)s [options] [script.py args... | -m module args...]",
        description="Start a group of ringcomm workers on this host (torchrun-compatible).",
        epilog="See the module docstring (pydoc ringcomm.launch) for details.")
    add = parser.add_argument
    actions = [
        add("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc",
            type=int, default=1, help="workers on this host (default 1)"),
        add("--nnodes", type=int, default=1, help="hosts in the job (default 1)"),
        add("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
            help="index of this host (default 0)"),
        add("--master-addr", "--master_addr", dest="master_addr",
            help="rank 0's host (default $MASTER_ADDR or 127.0.0.1)"),
        add("--master-port", "--master_port", dest="master_port", type=int,
            help="default $MASTER_PORT, a free port (1 node) or 29500"),
        add("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
            default=0, help="restart the whole group up to K times"),
        add("--timeout", type=float, help="collective deadline (RINGCOMM_TIMEOUT)"),
        add("--device", choices=("auto", "cpu", "gpu"),
            help="each worker's device: GPU LOCAL_RANK %% count (RINGCOMM_DEVICE)"),
        add("--on-failure", "--on_failure", dest="on_failure", choices=("stop", "continue"), default="stop",
            help="when a worker fails: stop every worker (default), or report it and let the "
                 "others go on (they shrink their communicators: RINGCOMM_ON_FAILURE)"),
    ]
    add("--no-prefix", "--no_prefix", dest="prefix", action="store_false",
        help="do not prefix worker output with [rank R]:")
    add("-m", dest="module", metavar="MODULE", help="run a module instead of a script")
    takes_value = {opt for action in actions for opt in action.option_strings}
    return parser, takes_value


def _split_argv(argv: list[str], takes_value: set[str]) -> tuple[list[str], list[str]]:
    """Split argv into launcher options and ``[script, args...]`` / ``[-m, module, args...]``.

    Done by hand so that the worker's arguments are passed on exactly as given.
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            return argv[:i], argv[i:]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        i += 2 if arg in takes_value else 1
    return argv, []


def parse_args(argv: list[str] | None = None, environ=None) -> LaunchConfig:
    environ = os.environ if environ is None else environ
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, takes_value = _build_parser()
    own, rest = _split_argv(argv, takes_value)
    ns = parser.parse_args(own)
    script, module, args = _program(parser, rest)
    _check_numbers(parser, ns)
    addr = ns.master_addr or environ.get("MASTER_ADDR") or "127.0.0.1"
    port, auto_port = _master_port(parser, ns, addr, environ)
    return LaunchConfig(nproc=ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank,
                        master_addr=addr, master_port=port, auto_port=auto_port,
                        max_restarts=ns.max_restarts, timeout=ns.timeout, device=ns.device,
                        on_failure=ns.on_failure, prefix=ns.prefix, script=script, module=module, args=args,
                        secret=_secret(parser, ns, addr, port, environ),
                        job_id=environ.get("RINGCOMM_JOB_ID") or (secrets.token_hex(8) if ns.nnodes == 1 else ""))


def _program(parser, rest):
    """``(script, module, args)`` of what each worker runs: ``-m module args``, ``script
    args``, or the default module (the trainer's main job)."""
    if rest and rest[0].startswith("-m"):
        module = rest[0][2:] or (rest[1] if len(rest) > 1 else "")
        if not module:
            parser.error("-m needs a module name")
        return None, module, rest[1:] if rest[0] != "-m" else rest[2:]
    if rest:
        if not os.path.exists(rest[0]):
            parser.error(f"script not found: {rest[0]}")
        return rest[0], None, rest[1:]
    return None, DEFAULT_MODULE, list(DEFAULT_ARGS)


def _check_numbers(parser, ns):
    if ns.nproc < 1 or ns.nnodes < 1:
        parser.error("--nproc and --nnodes must be at least 1")
    if not 0 <= ns.node_rank < ns.nnodes:
        parser.error(f"--node-rank must be in [0, {ns.nnodes - 1}]")
    if ns.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if ns.on_failure == "continue" and ns.max_restarts and ns.nnodes > 1:
        parser.error("--on-failure continue with --max-restarts restarts a job that failed as a whole on "
                     "one node only; with several nodes use one of them")
    if ns.timeout is not None and not 0 < ns.timeout < math.inf:  # also NaN and inf
        parser.error(f"--timeout must be a finite number of seconds > 0, got {ns.timeout}")


def _master_port(parser, ns, addr, environ):
    """``(port, auto_port)``: --master-port, else MASTER_PORT, else a free port on one node
    (chosen here) or the fixed multi-node default."""
    port = ns.master_port
    if port is None and environ.get("MASTER_PORT"):
        try:
            port = int(environ["MASTER_PORT"])
        except ValueError:
            parser.error(f"MASTER_PORT is not a number: {environ['MASTER_PORT']!r}")
    if port is not None:
        return port, False
    if ns.nnodes == 1:
        return free_port(addr), True
    return DEFAULT_MULTINODE_PORT, False


def _secret(parser, ns, addr, port, environ):
    """The job secret: RINGCOMM_SECRET, else RINGCOMM_SECRET_FILE's, else a fresh one on one
    node; across hosts one derived from the address only where insecure mode is allowed."""
    secret = environ.get("RINGCOMM_SECRET", "")
    if not secret and environ.get("RINGCOMM_SECRET_FILE"):
        try:
            secret = job_secret.from_file(environ["RINGCOMM_SECRET_FILE"])
        except ValueError as exc:
            parser.error(str(exc))
    if secret:
        return secret
    if ns.nnodes == 1:
        return secrets.token_hex(16)
    if job_secret.insecure(environ):
        log(f"warning: {job_secret.INSECURE_WARNING}")
        return job_secret.derived(addr, port)
    parser.error(job_secret.missing_secret_message(f"--nnodes {ns.nnodes} spans several hosts"))


def worker_env(cfg: LaunchConfig, local_rank: int, restart_count: int = 0,
               base_env=None) -> dict[str, str]:
    """The full environment of one worker."""
    env = dict(os.environ if base_env is None else base_env)
    env.update({
        "RANK": str(cfg.node_rank * cfg.nproc + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GROUP_RANK": str(cfg.node_rank),
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(cfg.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "RINGCOMM_RESTART_COUNT": str(restart_count),
        "RINGCOMM_SECRET": cfg.secret,
        "RINGCOMM_JOB_ID": cfg.job_id,
        "PYTHONUNBUFFERED": "1",
    })
    if cfg.nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    if cfg.timeout is not None:
        env["RINGCOMM_TIMEOUT"] = f"{cfg.timeout:g}"
    if cfg.device is not None:
        env["RINGCOMM_DEVICE"] = cfg.device
    if cfg.on_failure != "stop":
        env["RINGCOMM_ON_FAILURE"] = cfg.on_failure
    return env
