"""Emulated clusters for the tests in this folder (bench/netns.py: a network namespace per
host). ``cluster`` is parametrized indirectly with ``(hosts, ranks_per_host)``; where this
machine cannot build one (not root, no ``ip``/``tc``, namespaces refused) the test is
skipped, saying why."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench")))
import netns  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture
def cluster(request):
    why = netns.preflight()
    if why:
        pytest.skip(f"no emulated cluster here: {why}")
    hosts, per_host = request.param
    made = netns.Cluster(hosts, per_host)
    try:
        made.build()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        made.close()
        pytest.skip(f"no emulated cluster here: {exc}")
    yield made
    netns.kill_started()
    made.close()
