"""Ranks on several emulated hosts (a network namespace each, tests/hosts/hosts_worker.py),
one ``python -m ringcomm.launch`` per host, as on a real cluster: the hierarchical
collectives, their traffic across hosts and ``auto``'s choice. Needs root, ``ip`` and
``tc``; skipped, saying why, elsewhere."""
import os
import secrets

import pytest

import netns  # bench/netns.py, put on the path by conftest.py

pytestmark = pytest.mark.timeout(180)
WORKER = os.path.join(os.path.dirname(__file__), "hosts_worker.py")
PORT = 29777


@pytest.mark.parametrize("cluster", [(2, 2), (3, 2)], indirect=True, ids=["2x2", "3x2"])
def test_hierarchical_collectives_across_emulated_hosts(cluster):
    procs = netns.launch(cluster, [WORKER, str(cluster.hosts), str(cluster.per_host)], PORT,
                         secrets.token_hex(16), RINGCOMM_TIMEOUT="60")
    results = netns.finish(procs, 150)
    for out, rc in results:
        assert rc == 0, out[-3000:]
    said = results[0][0]
    # each rank's traffic left through its own link: every veth carried the rank's share
    sent = [tx for tx, _ in cluster.link_bytes()]
    assert min(sent) > 100_000, sent
    for check in ("ok topology", "ok all_reduce hier", "ok all_reduce ring", "ok all_reduce auto",
                  "ok reduce_scatter hier", "ok all_gather hier", "ok broadcast and reduce"):
        assert check in said, said[-3000:]
