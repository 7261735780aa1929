"""PyTorch's own backend test suite, ``torch.testing._internal.distributed.distributed_test``
(shipped in the torch wheel), run against Gloo and against ringcomm, test by test.

    python bench/torch_suite.py [--backends gloo,ringcomm] [--world-sizes 2,3] [-k EXPR]
                                [--timeout 300] [--init-method file|env] [--merge]
                                [--plugins ringcomm=ringcomm.torch]
                                [--features plugin,ddp,subgroup] [--verbose]
                                [--out bench/out/torch_suite]

    e.g. python bench/torch_suite.py --world-sizes 2 -k "all_gather_coalesced or test_barrier"

What PyTorch's test/distributed/test_distributed_spawn.py does, for one backend and world
size per pytest process: ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` (with ``barrier/`` and
``test_dir/``) and ``INIT_METHOD`` are set, and pytest runs bench/torch_suite_plugin.py, whose
one class is the suite (``TestDistBackend`` + ``DistributedTest._DistTestBase``). Each test
spawns WORLD_SIZE rank processes (multiprocessing *spawn*); a rank imports
bench/torch_suite_plugin.py to find its target, and that import registers the plugin backends
(``--plugins``: ``import ringcomm.torch``) and adds them to the suite's feature tables
(``--features``: ``DistTestCases.backend_feature["plugin"]``, ``["ddp"]``, ``["subgroup"]``)
before the suite module is imported, in every rank as in pytest's own process. A backend
``REAL-as-NAME`` (``ringcomm-as-gloo``) runs the suite as ``BACKEND=NAME`` (every skip and
branch the suite keeps for Gloo by name is taken) while every group torch.distributed creates
for NAME is a REAL group (see bench/torch_suite_plugin.py); its results go under that name.

Per-test outcomes: this file is also a pytest plugin (``-p torch_suite``) that appends one
JSON line per test phase to an events file as it happens, so a crash loses nothing already
run. Timeouts, three deep: the suite's own (``--timeout`` seconds per test, its
``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``; its own overrides such as 400 s for
test_ddp_uneven_inputs stay) kills the ranks and fails the test; pytest-timeout, where
installed, fails the test ``GRACE_S`` later; and this driver kills pytest's whole process group
``GRACE_S`` after that, records the test as an error and starts pytest again on the tests left.

Writes to ``--out``: ``torch_suite.json`` (per backend and world size: counts of passed,
failed, skipped and errors, and every test's outcome, duration and message), and per run
``BACKEND-wN.log`` (pytest's output) and ``BACKEND-wN.events.jsonl``. Prints a line per test
run (skips only with ``--verbose``), then a table of counts and, per world size, the tests
that pass on the reference backend (``--reference``, default gloo) but not on another, each
with its failure's first line. With ``--merge`` the runs already in torch_suite.json for
other backends or world sizes are kept (for example: gloo once, ringcomm after each fix).
Needs pytest and expecttest (the suite's common_utils imports it); takes about half an hour
per backend and world size on 2 cores.
"""
import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUITE_FILE = os.path.join(HERE, "torch_suite_plugin.py")
SUITE = "torch.testing._internal.distributed.distributed_test"
GRACE_S = 60  # pytest-timeout fires this long after the suite's own limit, the driver as long again
START_LIMIT_S = 600  # pytest may take this long to start (import the suite) or between tests
OUTCOMES = ("passed", "failed", "errors", "skipped")
DETAIL_CHARS = 4000


# ------------------------------------------------------------------------------------------
# The pytest plugin side (loaded into the pytest process with -p torch_suite).

_events = None


def _emit(**record):
    if _events is not None:
        _events.write(json.dumps(record) + "\n")
        _events.flush()


def pytest_configure(config):
    global _events
    path = os.environ.get("TORCH_SUITE_EVENTS")
    if path:
        _events = open(path, "a", buffering=1)  # noqa: SIM115 (open for the whole session)


def pytest_unconfigure(config):
    global _events
    if _events is not None:
        _events.close()
        _events = None


def _suite_limit(name):
    """The suite's own time limit for test ``name`` (its overrides, else the default)."""
    from torch.testing._internal.common_distributed import get_timeout
    return get_timeout("x." + name)


def pytest_collection_modifyitems(session, config, items):
    if not config.pluginmanager.hasplugin("timeout"):
        return
    import pytest
    for item in items:
        item.add_marker(pytest.mark.timeout(_suite_limit(item.name) + GRACE_S, method="signal"))


def pytest_collection_finish(session):
    _emit(event="collected", tests={item.nodeid: _suite_limit(item.name) for item in session.items})


def pytest_runtest_logstart(nodeid, location):
    _emit(event="start", nodeid=nodeid, t=time.time())


def pytest_runtest_logreport(report):
    text = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    elif report.outcome != "passed":
        text = report.longreprtext
    _emit(event="report", nodeid=report.nodeid, when=report.when, outcome=report.outcome,
          duration=report.duration, text=text[-20000:])


def pytest_runtest_logfinish(nodeid, location):
    _emit(event="finish", nodeid=nodeid, t=time.time())


# ------------------------------------------------------------------------------------------
# The driver side.

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="gloo,ringcomm", help="comma-separated (default: %(default)s)")
    p.add_argument("--world-sizes", default="2,3", help="comma-separated (default: %(default)s)")
    p.add_argument("-k", dest="k", default=None, help="pytest -k expression selecting tests")
    p.add_argument("--timeout", type=int, default=300,
                   help="the suite's per-test limit in seconds (its default: %(default)s)")
    p.add_argument("--init-method", choices=("file", "env"), default="file",
                   help="INIT_METHOD: file:// (test_barrier_timeout_global runs) or env:// "
                        "(default: %(default)s)")
    p.add_argument("--plugins", default="ringcomm=ringcomm.torch",
                   help="plugin backends as NAME=MODULE,...; importing MODULE registers NAME "
                        "(default: %(default)s)")
    p.add_argument("--features", default="plugin,ddp,subgroup",
                   help="DistTestCases.backend_feature entries the plugins claim (default: %(default)s)")
    p.add_argument("--reference", default="gloo", help="the backend the others are compared with")
    p.add_argument("--merge", action="store_true",
                   help="keep the other runs already in OUT/torch_suite.json")
    p.add_argument("--verbose", action="store_true", help="print skipped tests too")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "torch_suite"))
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    if any(w < 2 for w in args.world_sizes):
        p.error("world sizes must be at least 2")
    return args


def check_requirements():
    missing = [m for m in ("pytest", "expecttest", "torch")
               if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"torch_suite: missing {', '.join(missing)} in {sys.executable} "
                 f"(pip install {' '.join(missing)})")


def short(nodeid):
    return nodeid.rsplit("::", 1)[-1]


def error_lines(text):
    """The lines pytest marks as the error (``E   ...``), their common indentation removed."""
    return textwrap.dedent("\n".join(line[1:] for line in text.splitlines()
                                     if line == "E" or line.startswith("E "))).splitlines()


def headline(text):
    """A failure's first line: the exception a rank raised when the suite reports one
    ("rank N: ..."), else the first line pytest marks as the error, else the first line."""
    lines = error_lines(text) or text.splitlines()
    m = re.search(r"Process (\d+) exited with error code \d+ and exception:\n", "\n".join(lines))
    if m:
        in_traceback = False
        for line in "\n".join(lines)[m.end():].splitlines():
            if line.startswith("Traceback"):
                in_traceback = True
            elif in_traceback and line.strip() and not line.startswith(" "):
                return f"rank {m.group(1)}: {line.strip()}"
    return next((line.strip() for line in lines if line.strip()), "")


def detail(text):
    """What a failure says (pytest's E lines, else its tail), at most DETAIL_CHARS."""
    body = "\n".join(error_lines(text)) or text
    return body if len(body) <= DETAIL_CHARS else body[:DETAIL_CHARS // 2] + "\n...\n" + body[-DETAIL_CHARS // 2:]


def outcome_of(reports):
    """One test's outcome from its phases' reports {when: (outcome, text)}."""
    call = reports.get("call")
    if call and call[0] == "failed":
        return "failed", call[1]
    for when in ("setup", "teardown"):
        if when in reports and reports[when][0] == "failed":
            return "errors", reports[when][1]
    for when in ("setup", "call", "teardown"):
        if when in reports and reports[when][0] == "skipped":
            return "skipped", reports[when][1]
    if call and call[0] == "passed":
        return "passed", ""
    return "errors", "no result reported"


class Events:
    """Reads the events file as pytest appends to it."""

    def __init__(self, path):
        self.path, self.offset, self.partial = path, 0, ""

    def read(self):
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        data = self.partial + chunk
        lines = data.split("\n")
        self.partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def kill_group(proc):
    """End pytest and the ranks it spawned: the process group it leads (started in a session
    of its own)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # pytest is gone; its ranks may not be
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        break


def run_env(args, backend, world_size, temp_dir, events):
    env = dict(os.environ)
    for d in ("barrier", "test_dir"):
        os.makedirs(os.path.join(temp_dir, d), exist_ok=True)
    env.update({
        "BACKEND": backend.rpartition("-as-")[2],
        "TORCH_SUITE_AS": backend.rpartition("-as-")[0],
        "WORLD_SIZE": str(world_size),
        "TEMP_DIR": temp_dir,
        "INIT_METHOD": (f"file://{temp_dir}/shared_init_file" if args.init_method == "file" else "env://"),
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.timeout),
        "TORCH_SUITE_PLUGINS": args.plugins,
        "TORCH_SUITE_FEATURES": args.features,
        "TORCH_SUITE_EVENTS": events,
        "PYTHONPATH": os.pathsep.join(filter(None, [HERE, ROOT, env.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def build_command(ini, extra):
    # Our own ini and rootdir: the project's [tool:pytest] (testpaths, its 120 s timeout)
    # must not apply. Node ids are then relative to bench/.
    return [sys.executable, "-m", "pytest", "-c", ini, "--rootdir", HERE, "-p", "torch_suite",
            "-p", "no:cacheprovider", "-q", "-rN", *extra]


class Run:
    """One backend at one world size: collect, then run until every test has an outcome."""

    def __init__(self, args, backend, world_size):
        self.args, self.backend, self.world_size = args, backend, world_size
        self.tag = f"{backend}-w{world_size}"
        self.log_path = os.path.join(args.out, f"{self.tag}.log")
        self.events_path = os.path.join(args.out, f"{self.tag}.events.jsonl")
        self.ini = os.path.join(args.out, "pytest.ini")
        self.tests = {}  # nodeid -> record
        self.limits = {}
        self.order = []
        self.phases = {}  # nodeid -> {when: (outcome, text)}
        self.running = None  # (nodeid, start time)
        self.durations = {}
        self.attempts = 0
        self.t0 = time.time()

    def log(self, msg):
        print(f"[{self.tag} {fmt_elapsed(time.time() - self.t0)}] {msg}", flush=True)

    def execute(self):
        for path in (self.log_path, self.events_path):
            if os.path.exists(path):
                os.remove(path)
        with open(self.ini, "w") as f:
            f.write("[pytest]\n")
        temp_dir = tempfile.mkdtemp(prefix=f"torch_suite_{self.tag}_")
        try:
            self.env = run_env(self.args, self.backend, self.world_size, temp_dir, self.events_path)
            return self._execute()
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)

    def _execute(self):
        k = ["-k", self.args.k] if self.args.k else []
        self.events = Events(self.events_path)
        rc, _ = self.pytest(["--collect-only", SUITE_FILE, *k], START_LIMIT_S)
        for ev in self.events.read():
            if ev["event"] == "collected":
                self.limits = ev["tests"]
        self.order = list(self.limits)
        if not self.order:
            self.log(f"collected no tests (pytest rc {rc}); see {self.log_path}")
            return self.result(collect_rc=rc)
        self.log(f"{len(self.order)} tests; log {os.path.relpath(self.log_path)}")
        while True:
            todo = [n for n in self.order if n not in self.tests]
            if not todo:
                break
            self.attempts += 1
            before = len(self.tests)
            rc, hung = self.pytest([os.path.join(HERE, n) for n in todo], None)
            self.absorb(self.events.read())
            if self.running is not None:  # pytest died or was killed inside a test
                nodeid, started = self.running
                why = (f"hung: killed by torch_suite after {time.time() - started:.0f} s" if hung
                       else f"pytest exited (rc {rc}) during this test")
                self.finish(nodeid, "errors", why, duration=time.time() - started)
                self.running = None
            elif len(self.tests) == before:  # not one test got a result: give up on the rest
                why = f"pytest ran none of the tests left (rc {rc}); see {os.path.basename(self.log_path)}"
                for nodeid in todo:
                    self.finish(nodeid, "errors", why, quiet=True)
                self.log(why)
        return self.result()

    def pytest(self, extra, limit):
        """Run pytest on ``extra``; watch its events. Returns (rc, killed for a hang)."""
        cmd = build_command(self.ini, extra)
        with open(self.log_path, "a") as log:
            log.write(f"\n$ {' '.join(cmd[:12])} ... ({len(extra)} args)\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            idle_since = time.time()
            hung = False
            try:
                while proc.poll() is None:
                    time.sleep(0.5)
                    if limit is None:
                        if self.absorb(self.events.read()):
                            idle_since = time.time()
                        if self.running is not None:
                            nodeid, started = self.running
                            allowed = self.limits.get(nodeid, self.args.timeout) + 2 * GRACE_S
                            hung = time.time() - started > allowed
                        else:
                            hung = time.time() - idle_since > START_LIMIT_S
                    else:
                        hung = time.time() - idle_since > limit
                    if hung:
                        self.log("no progress: killing pytest")
                        break
            except KeyboardInterrupt:
                kill_group(proc)
                raise
            kill_group(proc)  # also ends ranks a finished pytest left behind
            return proc.wait(), hung

    def absorb(self, events):
        """Take new events; True if any arrived."""
        for ev in events:
            kind = ev["event"]
            if kind == "start":
                self.running = (ev["nodeid"], ev["t"])
                self.phases[ev["nodeid"]] = {}
            elif kind == "report":
                self.phases.setdefault(ev["nodeid"], {})[ev["when"]] = (ev["outcome"], ev["text"])
                self.durations[ev["nodeid"]] = self.durations.get(ev["nodeid"], 0.0) + ev["duration"]
            elif kind == "finish":
                self.running = None
                outcome, text = outcome_of(self.phases.get(ev["nodeid"], {}))
                self.finish(ev["nodeid"], outcome, text)
        return bool(events)

    def finish(self, nodeid, outcome, text, quiet=False, duration=None):
        if nodeid in self.tests:
            return
        duration = round(self.durations.get(nodeid, 0.0) if duration is None else duration, 2)
        record = {"outcome": outcome, "duration": duration}
        if outcome != "passed":
            record["message"] = headline(text) if outcome != "skipped" else text.strip()
        if outcome in ("failed", "errors"):
            record["detail"] = detail(text)
        self.tests[nodeid] = record
        if quiet or (outcome == "skipped" and not self.args.verbose):
            return
        n = len(self.tests)
        line = f"{n}/{len(self.order)} {outcome:7s} {short(nodeid)} ({duration:.1f}s)"
        if record.get("message"):
            line += f": {record['message'][:160]}"
        self.log(line)

    def result(self, collect_rc=None):
        counts = {o: 0 for o in OUTCOMES}
        for record in self.tests.values():
            counts[record["outcome"]] += 1
        counts["total"] = len(self.tests)
        out = {"counts": counts, "wall_s": round(time.time() - self.t0, 1), "k": self.args.k,
               "init_method": self.args.init_method, "timeout_s": self.args.timeout,
               "pytest_starts": self.attempts, "log": os.path.basename(self.log_path),
               "tests": {short(n): self.tests[n] for n in self.order if n in self.tests}}
        if collect_rc is not None:
            out["collect_rc"] = collect_rc
        self.log("  ".join(f"{o} {counts[o]}" for o in OUTCOMES) + f"  ({fmt_elapsed(out['wall_s'])})")
        return out


def fmt_elapsed(s):
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def differences(runs, reference):
    """Per world size: tests that pass on ``reference`` but not on another backend."""
    out = {}
    for ws in sorted({ws for per in runs.values() for ws in per}, key=int):
        ref = runs.get(reference, {}).get(ws)
        if ref is None:
            continue
        rows = []
        for backend, per in runs.items():
            if backend == reference or ws not in per:
                continue
            other = per[ws]["tests"]
            for name, rec in ref["tests"].items():
                if rec["outcome"] == "passed" and name in other and other[name]["outcome"] != "passed":
                    rows.append({"test": name, "backend": backend, "outcome": other[name]["outcome"],
                                 "message": other[name].get("message", "")})
        out[ws] = rows
    return out


def print_report(report, reference):
    runs = report["runs"]
    print("\nPyTorch distributed_test suite (torch %s)" % report["torch"])
    print(f"{'backend':16s} {'N':>2s} " + " ".join(f"{o:>7s}" for o in OUTCOMES) + f" {'total':>6s} {'wall':>8s}")
    for backend, per in runs.items():
        for ws in sorted(per, key=int):
            c = per[ws]["counts"]
            print(f"{backend:16s} {ws:>2s} " + " ".join(f"{c[o]:7d}" for o in OUTCOMES)
                  + f" {c['total']:6d} {fmt_elapsed(per[ws]['wall_s']):>8s}")
    for ws, rows in report["differences"].items():
        print(f"\nN={ws}: {len(rows)} tests pass on {reference} but not on the others")
        for row in rows:
            print(f"  {row['backend']:16s} {row['outcome']:7s} {row['test']}: {row['message'][:200]}")


def main(argv=None):
    args = parse_args(argv)
    check_requirements()
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "torch_suite.json")
    runs = {}
    if args.merge and os.path.exists(json_path):
        with open(json_path) as f:
            runs = json.load(f).get("runs", {})
    report = {"suite": SUITE, "torch": importlib.metadata.version("torch"),
              "args": {"backends": args.backends, "world_sizes": args.world_sizes, "k": args.k,
                       "timeout": args.timeout, "init_method": args.init_method,
                       "plugins": args.plugins, "features": args.features},
              "runs": runs}

    def save():
        report["differences"] = differences(runs, args.reference)
        tmp = json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, json_path)

    try:
        for ws in args.world_sizes:
            for backend in args.backends:
                runs.setdefault(backend, {})[str(ws)] = Run(args, backend, ws).execute()
                save()
    except KeyboardInterrupt:
        print("\ninterrupted: the report has the runs that finished", flush=True)
    save()
    print_report(report, args.reference)
    print(f"\nwrote {os.path.relpath(json_path)}")
    broken = [f"{b} N={ws}" for b, per in runs.items() for ws, run in per.items() if not run["counts"]["total"]]
    if broken:  # the suite did not even collect: a setup problem, not a backend's result
        sys.exit(f"torch_suite: no tests collected for {', '.join(broken)}; see their logs")


if __name__ == "__main__":
    main()
