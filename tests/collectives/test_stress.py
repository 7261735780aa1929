"""The stress proof in CI: bench/stress.py's short variant, real processes, both cores hogged
and ranks stopped at random, must end with every call right on every rank.

4 ranks run a few thousand small calls from one seeded plan (bench/stress_plan.py): every
verb with every algorithm it accepts, sub-groups interleaved with the world, queues of up to
64 async calls, send/recv, calls that mismatch on purpose, torch.distributed verbs where
torch is installed. The outcome does not depend on timing: the plan is fixed by the seed
(so is every rank's number of calls), and ``RINGCOMM_TIMEOUT`` (30 s) is far above the
longest stop (200 ms), so a stop may slow the job, never fail it.

A fast test beside it checks the oracle itself: a wrong or unwritten result cannot pass.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)

from stress_plan import Item, Plan, data, expected, kind_of, same_bits, sizes  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_thousands_of_mixed_calls_under_a_hog_and_random_stops_are_all_right(tmp_path):
    out = tmp_path / "stress.json"
    done = subprocess.run([sys.executable, os.path.join(BENCH, "stress.py"), "--nproc", "4", "--ops", "3000",
                           "--max-bytes", "64K", "--seed", "11", "--timeout", "30", "--min-stops", "5",
                           "--deadline", "200", "--out", str(out)],
                          capture_output=True, text=True, timeout=225)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    story = "\n".join(summary["problems"]) + "\n" + done.stdout[-4000:] + "".join(
        f"\n--- rank {r['rank']} log ---\n{r.get('log_tail', '')[-1500:]}" for r in summary["ranks"])
    for rep in summary["ranks"]:
        r = rep["rank"]
        assert not rep.get("missing"), f"rank {r} wrote no report\n{story}"
        assert rep["exceptions"] == 0, f"rank {r}: {rep['exception']}\n{story}"
        assert rep["wrong"] == 0, f"rank {r}: {rep['wrong_first']}\n{story}"
        assert rep["ops_planned"] > 1000 and rep["ops_done"] == rep["ops_planned"], story
        assert rep["returncode"] == 0, story
        assert rep["peak_rss_bytes"] <= rep["bound_bytes"], story
        assert rep["mismatches"] > 0, story  # the failing-on-purpose calls ran, and failed
    assert summary["stops"] >= 5, story       # the stops really happened
    assert summary["hogs"] >= 2, story
    assert summary["ok"] and done.returncode == 0, story


def written_before(item, name, r):
    """What buffer ``name`` of group rank ``r`` holds before ``item`` writes it; None where
    the call must leave it as it is (or keeps it: a broadcast root's x)."""
    if name == "out":
        return "garbage"
    if item.verb == "all_reduce" or (item.verb == "reduce" and r == item.root):
        return kind_of(item.verb)  # its own input, reduced in place
    if item.verb == "broadcast" and r != item.root:
        return "garbage"
    return None


def test_the_oracle_catches_a_wrong_or_unwritten_result():
    """For the plan's first calls, on every rank: the expected buffers have the sizes the
    calls take, a buffer with one byte changed fails, and an output the call never wrote
    (what it held before) fails wherever it is more than a few bytes."""
    plan = Plan(seed=11, n=4, max_bytes=64 << 10, torch=False)
    plan.initial_groups()
    checked = unwritten = 0
    steps = plan.steps()
    while checked < 600:
        for item in next(steps).items:
            if item.verb in ("barrier", "mismatch", "p2p"):
                continue
            checked += 1
            g = len(plan.groups[item.comm])
            for r in range(g):
                n_in, n_out = sizes(item, g)[r]
                for name, value in expected(11, item, g, r).items():
                    assert value.size == (n_in if name == "x" else n_out), (item, name)
                    if value.nbytes == 0:
                        continue
                    flipped = value.copy().reshape(-1).view(np.uint8)
                    flipped[-1] ^= 1
                    assert not same_bits(flipped.view(value.dtype), value), item
                    kind = written_before(item, name, r)
                    if kind is not None and value.nbytes >= 16:
                        unwritten += 1
                        assert not same_bits(data(11, item, r, value.size, kind), value), (item, name, r)
    assert unwritten > 100  # enough outputs were compared with what they held before


def test_a_result_that_matches_is_accepted():
    item = Item(id=3, verb="all_reduce", comm=0, dtype="float16", m=9, op="avg")
    inputs = [data(5, item, r, 9) for r in range(3)]
    total = inputs[0] + inputs[1] + inputs[2]
    assert same_bits(expected(5, item, 3, 1)["x"], np.true_divide(total, 3).astype(np.float16))
