"""Strangers stay out: peer connections and the rendezvous demand the job secret, and frames
from the network are validated before use (a bad one is dropped, never fatal)."""
import os
import struct
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest
import zmq

from harness import free_port, spawn_job
from ringcomm.transport import frame

pytestmark = pytest.mark.timeout(60)
SECRET = "0" * 32  # what the harness gives its jobs


def endpoints(comm):
    transport = comm._engine.transport
    return transport.local_endpoints, transport.rejected


def rejected_after_sum(comm):
    x = np.full(100_000, comm.rank + 1.0)
    comm.all_reduce(x)
    return bool(np.all(x == sum(range(1, comm.world_size + 1)))), comm._engine.transport.rejected


def good_header(src=1, seq=10 ** 6, nbytes=4, kind=frame.Kind.DATA):
    return frame.pack(kind, src, frame.Key(0, 0, seq, 0, 0), nbytes, bytes(16))


def send_all(endpoint, messages, password=None, wait=0.5):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    if password is not None:
        sock.plain_username, sock.plain_password = b"ringcomm", password.encode()
    sock.connect(endpoint)
    for parts in messages:
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
        except zmq.Again:  # refused: no pipe to the rank
            pass
    time.sleep(wait)
    ctx.destroy(0)


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
@pytest.mark.parametrize("password", [None, "wrong"])
def test_stranger_cannot_reach_a_rank(pools, kind, password):
    """Without the secret the handshake fails: not one frame reaches the rank."""
    pool = pools(2)
    (local, before), _ = pool.run(endpoints)
    send_all(local[kind], [[good_header(), b"\0" * 4], [b"junk"], [b"x" * 100, b"y"]], password)
    (ok0, after), (ok1, _) = pool.run(rejected_after_sum)
    assert ok0 and ok1
    assert after == before, "a frame from a stranger reached the rank"


def test_malformed_frames_from_an_authenticated_peer_are_dropped(pools):
    """Even with the secret, a malformed frame is rejected with a log line and counted."""
    pool = pools(2)
    (local, before), _ = pool.run(endpoints)
    bad = [
        [b"RCM2" + good_header()[4:], b"\0" * 4],               # foreign magic
        [good_header()[:-3], b"\0" * 4],                         # truncated header
        [good_header(), b"\0" * 4, b"extra"],                    # three frames
        [good_header(nbytes=1 << 40), b"\0" * 4],                # claims a terabyte
        [good_header(src=7), b"\0" * 4],                         # no such rank
        [good_header(src=0), b"\0" * 4],                         # claims to be the receiver
        [good_header(kind=frame.Kind.ABORT, nbytes=5000), b"a" * 5000],   # oversized abort
        [struct.pack("<4sB", b"RCM1", 9) + b"\0" * 51, b""],     # future wire version
    ]
    send_all(local["tcp"], bad, SECRET)
    (ok0, after), (ok1, _) = pool.run(rejected_after_sum)
    assert ok0 and ok1
    assert after - before == len(bad)


JOIN = textwrap.dedent("""
    import numpy as np, ringcomm
    comm = ringcomm.init()
    x = np.ones(10) * (comm.rank + 1)
    comm.all_reduce(x)
    print("sum", x[0])
""")


def test_stranger_at_the_rendezvous_is_ignored():
    """Junk and forged HELLOs at rank 0's rendezvous port do not disturb the job."""
    port = free_port()
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.linger = 0
    stranger.connect(f"tcp://127.0.0.1:{port}")
    forged = b'{"rank": 1, "world_size": 2, "entry": {}, "settings": {}}'
    for parts in ([b"junk"], [forged, b"\0" * 32], [b"a", b"b", b"c", b"d"]):
        stranger.send_multipart(parts)
    results = spawn_job(JOIN, 2, env={"MASTER_PORT": str(port)}, timeout=40)
    ctx.destroy(0)
    for code, out, err in results:
        assert code == 0 and "sum 3.0" in out, err


def test_rank_with_the_wrong_secret_cannot_join():
    script = JOIN.replace("ringcomm.init()", "ringcomm.init(timeout=3)")
    import os
    import subprocess
    import sys
    from harness import job_env
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, **job_env(r, 2, port, {"RINGCOMM_SECRET": s})))
             for r, s in ((0, SECRET), (1, "1" * 32))]
    outs = [p.communicate(timeout=30) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert "did not join" in outs[0][1] and "no answer from the rendezvous" in outs[1][1]


def test_encrypted_job():
    for code, out, err in spawn_job(JOIN, 3, env={"RINGCOMM_ENCRYPT": "1"}, timeout=40):
        assert code == 0 and "sum 6.0" in out, err


def test_ranks_that_disagree_on_encryption_fail_clearly():
    script = JOIN.replace("ringcomm.init()", "ringcomm.init(timeout=5, encrypt=comm_encrypt)").replace(
        "import numpy as np, ringcomm", "import os, numpy as np, ringcomm\ncomm_encrypt = os.environ['RANK'] == '0'")
    results = spawn_job(script, 2, timeout=40)
    assert all(code != 0 for code, _, _ in results)
    assert any("refused the connection" in err for _, _, err in results), results


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux's")
def test_ipc_sockets_leave_no_file_behind(pools):
    """On Linux the inbound ipc socket lives in the abstract namespace: a killed rank leaves
    nothing in /tmp (a stranger reaching it still has to prove the secret, tested above)."""
    (local, _), _ = pools(2).run(endpoints)
    assert local["ipc"].startswith("ipc://@ringcomm-")
    assert not os.path.exists(local["ipc"][len("ipc://@"):])
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), local["ipc"][len("ipc://@"):]))
