"""Stress proof over real processes: N ranks run thousands of mixed, checked collectives while
both cores are hogged and ranks are stopped (SIGSTOP) at random for 50–200 ms.

    python bench/stress.py [--nproc 4] [--seconds 150 | --ops 3000] [--seed 1] [--out stress.json]

The driver starts the ranks itself with torchrun's variables (as tests/harness.py's
``spawn_job`` does: RANK, WORLD_SIZE, MASTER_ADDR/PORT, a job secret), so it knows their
pids; every child (ranks and hogs) is armed to die with it (PR_SET_PDEATHSIG). Once every
rank has joined and measured its baseline memory it starts one busy-loop process per core,
lets the ranks go, and until they finish stops a random rank at random moments for a random
50–200 ms (then SIGCONT; a stopped rank is always continued, and at the end or on any error
every rank is continued, the hogs killed, and ranks still running killed).

The ranks run bench/stress_worker.py on one plan drawn from ``--seed`` (bench/stress_plan.py)
and each writes a JSON report. The driver prints a table per rank (ops done / planned,
wrong results, exceptions, stops suffered, peak RSS against README's bound) and writes the
whole of it to ``--out``. Exit status 0 only when every rank finished its plan with no wrong
result and no exception, exited 0, stayed within the bound, and at least ``--min-stops``
stops happened.

``RINGCOMM_TIMEOUT`` is set far above the longest stop (``--timeout``, default 30 s): a
stopped rank must only slow the others down, never fail them.
"""
import argparse
import contextlib
import ctypes
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # ringcomm.env.free_port, when run from a checkout without install

from ringcomm.env import free_port  # noqa: E402
from ringcomm.units import parse_size  # noqa: E402

PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_driver():
    """In the child, before exec: the kernel kills it (even a stopped one) when the driver dies."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_hogs(count):
    """``count`` processes that spin forever: every core stays busy under the job."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=_die_with_driver,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]


def start_ranks(args, workdir):
    port, torch_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    common = {"WORLD_SIZE": str(args.nproc), "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "RINGCOMM_SECRET": secrets.token_hex(16),
              "RINGCOMM_JOB_ID": f"stress-{os.getpid()}", "RINGCOMM_TIMEOUT": str(args.timeout),
              "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
              "PYTHONPATH": os.pathsep.join(filter(None, [HERE, ROOT, os.environ.get("PYTHONPATH")]))}
    length = ["--ops", str(args.ops)] if args.ops is not None else ["--seconds", str(args.seconds)]
    if args.window is not None:  # fewer collectives ahead: backpressure holds ranks more often
        common["RINGCOMM_COLLECTIVE_WINDOW"] = str(args.window)
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, **common, RANK=str(rank), LOCAL_RANK=str(rank))
        cmd = [sys.executable, os.path.join(HERE, "stress_worker.py"), "--seed", str(args.seed), *length,
               "--max-bytes", str(args.max_bytes), "--sync-dir", workdir,
               "--report", os.path.join(workdir, f"rank{rank}.json")]
        if args.torch:
            cmd += ["--torch-port", str(torch_port)]
        log = open(os.path.join(workdir, f"rank{rank}.log"), "w")  # noqa: SIM115 (the child writes it)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      preexec_fn=_die_with_driver))
        log.close()
    return procs


class Stopper:
    """Stops one running rank at a time, at random moments, for a random while; keeps count."""

    def __init__(self, procs, rng, stop_ms, gap_ms):
        self.procs, self.rng, self.stop_ms, self.gap_ms = procs, rng, stop_ms, gap_ms
        self.stops = [0] * len(procs)
        self.stopped_s = [0.0] * len(procs)
        self.stopped = None  # the rank stopped right now

    def one(self):
        """Sleep a random gap, then stop a random live rank for 50–200 ms (or as told)."""
        time.sleep(self.rng.uniform(*self.gap_ms) / 1000)
        live = [r for r, p in enumerate(self.procs) if p.poll() is None]
        if not live:
            return
        rank = self.rng.choice(live)
        pause = self.rng.uniform(*self.stop_ms) / 1000
        try:
            self.stopped = rank
            os.kill(self.procs[rank].pid, signal.SIGSTOP)
            began = time.monotonic()
            time.sleep(pause)
        except ProcessLookupError:
            return
        finally:
            self.cont_all()
        self.stops[rank] += 1
        self.stopped_s[rank] += time.monotonic() - began

    def cont_all(self):
        """SIGCONT every rank still there: never leave one stopped."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
        self.stopped = None


def wait_ready(procs, workdir, deadline):
    while True:
        if all(os.path.exists(os.path.join(workdir, f"ready{r}")) for r in range(len(procs))):
            return
        for r, p in enumerate(procs):
            if p.poll() is not None:
                raise RuntimeError(f"rank {r} exited with {p.returncode} before the stress began")
        if time.monotonic() > deadline:
            raise RuntimeError("the ranks did not all get ready in time")
        time.sleep(0.05)


def run(args):
    """Run the job; the summary (also what --out gets)."""
    workdir = tempfile.mkdtemp(prefix="ringcomm-stress-")
    rng = random.Random(args.seed * 7919 + 1)  # the stops' moments: seeded, not part of the plan
    hogs, procs, stopper, notes = [], [], None, []
    started = time.monotonic()
    stress_began = None
    try:
        procs = start_ranks(args, workdir)
        wait_ready(procs, workdir, started + args.deadline)
        hogs = start_hogs(args.hogs)
        stopper = Stopper(procs, rng, args.stop_ms, args.gap_ms)
        stress_began = time.monotonic()
        with open(os.path.join(workdir, "go"), "w"):
            pass
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now - started > args.deadline:
                notes.append(f"deadline of {args.deadline} s passed: ranks killed")
                break
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # the others get a grace to report (PeerLost within about 1 s)
            if failed_at is not None:
                if now - failed_at > args.grace:
                    notes.append(f"a rank failed; the rest killed {args.grace} s later")
                    break
                time.sleep(0.1)
                continue
            stopper.one()
    except RuntimeError as exc:  # from wait_ready: reported with the ranks' logs below
        notes.append(f"start-up failed: {exc}")
    finally:
        if stopper is not None:
            stopper.cont_all()
        else:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
        for h in hogs:
            h.kill()
            h.wait()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    wall = time.monotonic() - started
    stress_wall = time.monotonic() - stress_began if stress_began else 0.0
    return summarize(args, workdir, procs, stopper, notes, wall, stress_wall)


def summarize(args, workdir, procs, stopper, notes, wall, stress_wall):
    ranks = []
    for r, p in enumerate(procs):
        path = os.path.join(workdir, f"rank{r}.json")
        report = json.loads(Path(path).read_text()) if os.path.exists(path) else {"rank": r, "missing": True}
        report["returncode"] = p.returncode
        report["stops"] = stopper.stops[r] if stopper else 0
        report["stopped_s"] = round(stopper.stopped_s[r], 3) if stopper else 0.0
        with open(os.path.join(workdir, f"rank{r}.log")) as f:
            report["log_tail"] = f.read()[-4000:]
        ranks.append(report)
    problems = list(notes)
    for rep in ranks:
        r = rep["rank"]
        if rep.get("missing"):
            problems.append(f"rank {r}: no report (exit {rep['returncode']})")
            continue
        if rep["returncode"] != 0:
            problems.append(f"rank {r}: exit code {rep['returncode']}")
        if rep["exceptions"]:
            problems.append(f"rank {r}: {rep['exception']['type']}: {rep['exception']['message'][:300]}")
        if rep["wrong"]:
            problems.append(f"rank {r}: {rep['wrong']} wrong results, first: {rep['wrong_first'][:1]}")
        if rep["ops_done"] != rep["ops_planned"]:
            problems.append(f"rank {r}: {rep['ops_done']} of {rep['ops_planned']} ops done")
        if rep["peak_rss_bytes"] > rep["bound_bytes"]:
            problems.append(f"rank {r}: peak RSS {rep['peak_rss_bytes']} B above the bound {rep['bound_bytes']} B")
    stops = sum(stopper.stops) if stopper else 0
    if stops < args.min_stops:
        problems.append(f"only {stops} stops happened (at least {args.min_stops} wanted)")
    return {"ok": not problems, "problems": problems, "nproc": args.nproc, "seed": args.seed,
            "ops": args.ops, "seconds": args.seconds, "max_bytes": args.max_bytes, "torch": args.torch,
            "hogs": args.hogs, "timeout_s": args.timeout, "stops": stops, "wall_s": round(wall, 2),
            "stress_wall_s": round(stress_wall, 2), "workdir": workdir, "ranks": ranks}


def table(summary):
    """Per rank: calls, wrong results, exceptions, stops, backpressure stalls, memory. "grow":
    peak RSS − baseline; "W·Bmax": README's collective term alone (no point-to-point windows),
    beside the whole bound (baseline + own buffers + every term)."""
    mib = 1 / (1 << 20)
    lines = [f"{'rank':>4} {'ops done/planned':>17} {'wrong':>5} {'exc':>3} {'stops':>5} {'stopped s':>9} "
             f"{'stalls':>6} {'base MiB':>8} {'peak MiB':>8} {'grow MiB':>8} {'W·Bmax MiB':>10} "
             f"{'bound MiB':>9} {'wall s':>6}"]
    for rep in summary["ranks"]:
        if rep.get("missing"):
            lines.append(f"{rep['rank']:>4} no report (exit {rep['returncode']})")
            continue
        stalls = rep.get("credit_stalls")
        lines.append(f"{rep['rank']:>4} {rep['ops_done']:>8}/{rep['ops_planned']:<8} {rep['wrong']:>5} "
                     f"{rep['exceptions']:>3} {rep['stops']:>5} {rep['stopped_s']:>9.2f} "
                     f"{'-' if stalls is None else stalls:>6} {rep['baseline_bytes'] * mib:>8.1f} "
                     f"{rep['peak_rss_bytes'] * mib:>8.1f} "
                     f"{(rep['peak_rss_bytes'] - rep['baseline_bytes']) * mib:>8.1f} "
                     f"{rep['collective_part_bytes'] * mib:>10.1f} {rep['bound_bytes'] * mib:>9.1f} "
                     f"{rep['wall_s']:>6.1f}")
    lines.append(f"{summary['stops']} stops in {summary['stress_wall_s']} s of stress ({summary['wall_s']} s in "
                 f"all); {'OK' if summary['ok'] else 'FAILED'}")
    lines += [f"  problem: {p}" for p in summary["problems"]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float, help="stress this long (the ranks agree when to stop)")
    length.add_argument("--ops", type=int, help="calls in the plan (default 3000 when neither is given)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="JSON summary")
    p.add_argument("--max-bytes", type=parse_size, default=1 << 20, help="largest buffer (default 1M)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="skip the torch.distributed steps")
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy-loop processes (default: one per core)")
    p.add_argument("--stop-ms", type=float, nargs=2, default=(50, 200), metavar=("MIN", "MAX"))
    p.add_argument("--gap-ms", type=float, nargs=2, default=(0, 300), metavar=("MIN", "MAX"),
                   help="time between two stops")
    p.add_argument("--min-stops", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0, help="RINGCOMM_TIMEOUT of the ranks")
    p.add_argument("--window", type=int, help="RINGCOMM_COLLECTIVE_WINDOW of the ranks (default: ringcomm's, 16)")
    p.add_argument("--deadline", type=float, help="kill everything after this many seconds (default: "
                                                  "the length + 300 s, or 600 s for --ops)")
    p.add_argument("--keep", action="store_true", help="keep the ranks' reports and logs (kept anyway on failure)")
    p.add_argument("--grace", type=float, default=10.0, help="after a rank fails, time the others get to report")
    args = p.parse_args(argv)
    if args.ops is None and args.seconds is None:
        args.ops = 3000
    if args.deadline is None:
        args.deadline = args.seconds + 300 if args.seconds is not None else 600.0
    if args.torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("stress: torch is not installed; running without the torch.distributed steps", file=sys.stderr)
            args.torch = False
    # a SIGTERM (a test's timeout, a Ctrl-C'd parent) still continues, kills and reports
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary = run(args)
    print(table(summary), flush=True)
    if summary["ok"] and not args.keep:
        shutil.rmtree(summary["workdir"], ignore_errors=True)  # the logs are in --out already
    else:
        print(f"stress: the ranks' reports and logs are in {summary['workdir']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
