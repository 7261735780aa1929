"""End-to-end tests of ``python -m ringcomm.selfcheck`` under the launcher.

Each test starts real worker processes that talk over ZeroMQ, so these are the slowest
tests of the suite: a few seconds each with ``--quick``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRUBBED = ("MASTER_ADDR", "MASTER_PORT", "RINGCOMM_SECRET", "RINGCOMM_TIMEOUT",
            "RINGCOMM_SEGMENT_BYTES", "RINGCOMM_TRANSPORT", "OMP_NUM_THREADS", "RANK",
            "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
            "RINGCOMM_RESTART_COUNT")
TABLE_HEADER = ("collective", "algorithm", "checks", "failures")
BANDWIDTH_HEADER = ("size", "count", "type", "time", "algbw", "busbw", "ps/ring", "#wrong")
MIB = 1 << 20


def launch(*args, timeout):
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "ringcomm.launch", *map(str, args)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def rank0_lines(stdout):
    prefix = "[rank 0]: "
    return [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]


def has_line_with(lines, words):
    return any(all(word in line.split() for word in words) for line in lines)


def explain(result):
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_quick_selfcheck_passes(tmp_path, nproc):
    report = tmp_path / "selfcheck.json"
    result = launch("--nproc", nproc, "-m", "ringcomm.selfcheck", "--quick", "--json", report,
                    timeout=80)
    assert result.returncode == 0, explain(result)
    lines = rank0_lines(result.stdout)
    assert lines[-1].startswith("selfcheck: PASSED ("), explain(result)
    assert has_line_with(lines, TABLE_HEADER), explain(result)
    assert not [line for line in result.stdout.splitlines() if line.startswith("[rank 1]")], \
        "ranks other than 0 must stay quiet when everything passes"

    data = json.loads(report.read_text())
    assert data["world_size"] == nproc and data["passed"] is True
    assert data["checks"] > 0 and data["failures"] == 0 and data["failed_checks"] == []
    assert lines[-1] == f"selfcheck: PASSED ({data['checks']} checks)"
    assert sum(row["checks"] for row in data["collectives"]) == data["checks"]
    rows = {(row["collective"], row["algorithm"]): row for row in data["collectives"]}
    for collective in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
                       "barrier", "group all_reduce"):
        for algorithm in ("ring", "ps", "auto"):
            assert rows[collective, algorithm]["checks"] > 0, (collective, algorithm)
    assert (("send/recv", "-") in rows) == (nproc > 1)
    assert all(row["failures"] == 0 for row in data["collectives"])

    n, accounting = nproc, data["byte_accounting"]
    S = accounting["size_bytes"]
    assert S == MIB
    ring, ps = accounting["ring"], accounting["ps"]
    assert ring["ok"] and ps["ok"]
    assert len(ring["bytes_sent"]) == n and sum(ring["bytes_sent"]) == 2 * (n - 1) * S
    for sent in ring["bytes_sent"]:  # chunks differ by at most one float32 element
        assert abs(sent - 2 * (n - 1) * S / n) <= 2 * (n - 1) * 4
    assert ps["bytes_sent"] == [(n - 1) * S] + [S] * (n - 1)
    assert ps["bytes_received"] == [(n - 1) * S] + [S] * (n - 1)

    if nproc == 1:
        assert data["bandwidth"] is None
        assert any("bandwidth: skipped" in line for line in lines)
    else:
        assert has_line_with(lines, BANDWIDTH_HEADER), explain(result)
        assert [row["size_bytes"] for row in data["bandwidth"]] == [4096, MIB]
        for row in data["bandwidth"]:
            assert row["wrong"] == 0 and row["count"] * 4 == row["size_bytes"]
            for algorithm in ("ring", "ps"):
                assert row[algorithm]["time_us"] > 0
                assert row[algorithm]["busbw"] == pytest.approx(
                    row[algorithm]["algbw"] * 2 * (n - 1) / n)


@pytest.mark.timeout(60)
def test_selfcheck_full_default():
    """The full self-check (no --quick), as a user runs it: -m ringcomm.selfcheck."""
    result = launch("--nproc", 2, "-m", "ringcomm.selfcheck", timeout=55)
    assert result.returncode == 0, explain(result)
    lines = rank0_lines(result.stdout)
    assert lines[0].startswith("ringcomm selfcheck: 2 ranks")
    assert lines[-1].startswith("selfcheck: PASSED (")
    assert has_line_with(lines, TABLE_HEADER) and has_line_with(lines, BANDWIDTH_HEADER)


BROKEN = {
    # rank 1 gets a wrong element from every ring all-reduce longer than 5
    "wrong result": """
        def all_reduce(link, x, op):
            original(link, x, op)
            if link.rank == 1 and x.size > 5:
                x[5] += 1
        """,
    # rank 1 raises inside the ring all-reduce of 1009 elements
    "exception": """
        def all_reduce(link, x, op):
            if link.rank == 1 and x.size == 1009:
                raise IndexError("injected failure")
            original(link, x, op)
        """,
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_collective_is_reported(tmp_path, kind):
    script = tmp_path / "broken_selfcheck.py"
    script.write_text("import sys\nfrom ringcomm import selfcheck\nfrom ringcomm.algorithms import ring\n"
                      "original = ring.all_reduce\n" + textwrap.dedent(BROKEN[kind]) +
                      "ring.all_reduce = all_reduce\nsys.exit(selfcheck.main(sys.argv[1:]))\n")
    result = launch("--nproc", 3, script, "--quick", "--sizes", "4KiB", timeout=80)
    assert result.returncode != 0, explain(result)
    lines = rank0_lines(result.stdout)
    assert lines[-1].startswith("selfcheck: FAILED ("), explain(result)
    stderr = result.stderr
    assert "[rank 1]: selfcheck: rank 1: FAIL all_reduce algorithm=ring dtype=float32" in stderr
    if kind == "wrong result":
        assert "first at index 5" in stderr and "results differ across ranks" in stderr
        ps_row = [line.split() for line in lines if line.split()[:2] == ["all_reduce", "ps"]]
        assert ps_row and ps_row[0][3] == "0"  # the parameter-server path still passes
    else:
        assert "IndexError: injected failure" in stderr and "stopped after an exception" in lines[-1]
