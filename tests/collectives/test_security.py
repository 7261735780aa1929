"""Strangers stay out: peer connections and the rendezvous demand the job secret, and frames
from the network are validated before use (a bad one is dropped, never fatal)."""
import contextlib
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import zmq

from harness import RankPool, free_port, job_env, spawn_job
from ringcomm import rundir
from ringcomm.transport import frame, rendezvous
from ringcomm.transport.security import peer_proof

pytestmark = pytest.mark.timeout(60)
SECRET = "0" * 32  # what the harness gives its jobs


def endpoints(comm):
    transport = comm._engine.session.wire
    return transport.bound, transport.rejected


def rejected_after_sum(comm):
    x = np.full(100_000, comm.rank + 1.0)
    comm.all_reduce(x)
    return bool(np.all(x == sum(range(1, comm.world_size + 1)))), comm._engine.session.wire.rejected


def good_header(src=1, seq=10 ** 6, nbytes=4, kind=frame.Kind.DATA):
    return frame.pack(kind, src, frame.Key(0, 0, seq, 0, 0), nbytes, bytes(16))


def proof(socket_id, secret=SECRET, rank=1, nonce="ab" * 16):
    """The PLAIN credentials a rank shows the socket ``socket_id``."""
    return str(rank), f"{nonce}:{peer_proof(secret, socket_id, rank, nonce)}"


def send_all(endpoint, messages, credentials=None, wait=0.5):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    if credentials is not None:
        sock.plain_username, sock.plain_password = (c.encode() for c in credentials)
    sock.connect(endpoint)
    for parts in messages:
        with contextlib.suppress(zmq.Again):  # refused: no pipe to the rank
            sock.send_multipart(parts, zmq.NOBLOCK)
    time.sleep(wait)
    ctx.destroy(0)


@pytest.fixture(scope="module")
def tcp_pool():
    pool = RankPool(2, env={"RINGCOMM_TRANSPORT": "tcp"})
    yield pool
    pool.close()


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
@pytest.mark.parametrize("credentials", ["none", "password", "wrong secret"])
def test_stranger_cannot_reach_a_rank(pools, tcp_pool, kind, credentials):
    """Without proving the secret the handshake fails: not one frame reaches the rank."""
    pool = tcp_pool if kind == "tcp" else pools(2)
    (local, before), _ = pool.run(endpoints)
    shown = {"none": None, "password": ("ringcomm", SECRET),
             "wrong secret": proof(local["id"], secret="1" * 32)}[credentials]
    send_all(local[kind], [[good_header(), b"\0" * 4], [b"junk"], [b"x" * 100, b"y"]], shown)
    (ok0, after), (ok1, _) = pool.run(rejected_after_sum)
    assert ok0 and ok1
    assert after == before, "a frame from a stranger reached the rank"


def test_a_proof_for_another_socket_or_malformed_credentials_reach_nothing(pools):
    """A valid proof made for rank 1's socket is refused at rank 0's; garbage credentials
    (non-ASCII, missing parts) are refused and do not stop the rank from accepting later
    connections."""
    pool = pools(2)
    (local0, before), (local1, _) = pool.run(endpoints)
    for shown in [proof(local1["id"], nonce=os.urandom(16).hex()), ("1", "a" * 32 + ":\u00e9\u00e9"),
                  ("x", "y"), ("1", "no-colon"), ("99", "a" * 32 + ":" + "0" * 64)]:
        send_all(local0["ipc"], [[b"junk"]], shown, wait=0.2)
    (_, after), _ = pool.run(rejected_after_sum)
    assert after == before
    send_all(local0["ipc"], [[b"junk"]], proof(local0["id"], nonce=os.urandom(16).hex()))
    (ok0, last), (ok1, _) = pool.run(rejected_after_sum)
    assert ok0 and ok1 and last == before + 1  # the handshake checker still works


def test_a_replayed_connection_proof_is_refused(pools):
    """A proof is accepted once: whoever replays a recorded handshake reaches nothing."""
    pool = pools(2)
    (local, before), _ = pool.run(endpoints)
    shown = proof(local["id"], nonce=os.urandom(16).hex())
    send_all(local["ipc"], [[b"junk"]], shown)  # the first use: one bad frame gets in
    (_, middle), _ = pool.run(rejected_after_sum)
    send_all(local["ipc"], [[b"junk"], [b"junk"]], shown)  # the replay: refused
    (ok0, after), (ok1, _) = pool.run(rejected_after_sum)
    assert ok0 and ok1
    assert middle == before + 1 and after == middle


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
    send_all(local["ipc"], bad, proof(local["id"], nonce=os.urandom(16).hex()))
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


def start_rank(rank, world_size, port, script=JOIN, **extra):
    env = dict(os.environ, **job_env(rank, world_size, port, extra))
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_listening(port, timeout=20):
    """Until something accepts TCP connections at ``port`` (rank 0's rendezvous is open)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens at {port}")


def finish(procs, timeout=40):
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outs, strict=True)]


def challenged(ctx, port):
    """A connection to the rendezvous that said HELLO: (socket, client nonce, its challenge)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{port}")
    nonce = os.urandom(rendezvous.NONCE_BYTES)
    sock.send_multipart([b"HELLO", nonce])
    assert sock.poll(10_000), "no challenge"
    kind, server_nonce, job, mac = sock.recv_multipart()
    assert kind == b"CHALLENGE" and rendezvous.verified(SECRET, mac, b"challenge", nonce, server_nonce, job)
    return sock, nonce, server_nonce


def signed_join(nonce, server_nonce, rank=1, job=""):
    body = json.dumps({"rank": rank, "world_size": 2, "job": job, "settings": {},
                       "entry": {"host": "x", "ipc": "ipc:///nowhere", "tcp": None, "id": "0"}}).encode()
    return [b"JOIN", body, rendezvous.sign(SECRET, b"join", nonce, server_nonce, body)]


def test_stranger_and_replayed_joins_at_the_rendezvous_are_ignored():
    """Junk, a forged JOIN, and a correctly signed JOIN replayed on another connection (or
    on one that was never challenged) leave the rendezvous undisturbed."""
    port = free_port()
    rank0 = start_rank(0, 2, port)
    wait_listening(port)
    ctx = zmq.Context()
    try:
        recorded, nonce, server_nonce = challenged(ctx, port)  # what a sniffer saw
        replay = signed_join(nonce, server_nonce)
        other, _, _ = challenged(ctx, port)
        other.send_multipart(replay)                     # answered another challenge
        fresh = ctx.socket(zmq.DEALER)
        fresh.linger = 0
        fresh.connect(f"tcp://127.0.0.1:{port}")
        for parts in ([b"junk"], replay, [b"JOIN", replay[1], b"\0" * 32], [b"a", b"b", b"c", b"d"]):
            fresh.send_multipart(parts)
        time.sleep(0.5)
        results = finish([rank0, start_rank(1, 2, port)])
    finally:
        ctx.destroy(0)
    for code, out, err in results:
        assert code == 0 and "sum 3.0" in out, err
    assert "ignored a join that does not answer its challenge" in results[0][2]


def test_a_rank_of_another_job_on_the_same_port_is_refused_alone():
    """Same port, same secret, another launch: that rank fails, this job is untouched."""
    port = free_port()
    rank0 = start_rank(0, 2, port, RINGCOMM_JOB_ID="job-a")
    wait_listening(port)
    (code, _, err), = finish([start_rank(1, 2, port, RINGCOMM_JOB_ID="job-b")])
    assert code != 0 and "belongs to job 'job-a'" in err, err
    for code, out, err in finish([rank0, start_rank(1, 2, port, RINGCOMM_JOB_ID="job-a")]):
        assert code == 0 and "sum 3.0" in out, err


def test_a_rank_joining_twice_is_refused_alone():
    port = free_port()
    first = [start_rank(0, 3, port), start_rank(1, 3, port)]
    wait_listening(port)
    time.sleep(1.0)  # rank 1 has joined
    (code, _, err), = finish([start_rank(1, 3, port)])
    assert code != 0 and "joined twice" in err, err
    for code, out, err in finish(first + [start_rank(2, 3, port)]):
        assert code == 0 and "sum 6.0" in out, err


def test_rank_with_the_wrong_secret_cannot_join():
    script = JOIN.replace("ringcomm.init()", "ringcomm.init(timeout=3)")
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


def test_ipc_sockets_live_in_a_private_directory(pools):
    """Only this user can open the directory of the ipc sockets; a killed rank's socket file
    is removed at the next start-up."""
    (local, _), _ = pools(2).run(endpoints)
    path = local["ipc"][len("ipc://"):]
    directory = os.path.dirname(path)
    assert directory == rundir.path() and os.path.exists(path)
    info = os.lstat(directory)
    assert stat.S_ISDIR(info.st_mode) and info.st_mode & 0o777 == 0o700 and info.st_uid == os.getuid()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = os.path.join(directory, f"{rundir.owner(int(dead))}-deadbeef.sock")
    foreign = os.path.join(directory, f"1.{dead}-deadbeef.sock")  # another pid namespace
    open(stale, "w").close()
    open(foreign, "w").close()
    for code, _out, err in spawn_job(JOIN, 2, timeout=40):
        assert code == 0, err
    assert not os.path.exists(stale) and os.path.exists(foreign)
    os.unlink(foreign)


def test_a_run_directory_chosen_for_the_job_that_others_can_open_is_refused(tmp_path, monkeypatch):
    """RINGCOMM_RUN_DIR was chosen by whoever set it: refused, not replaced (the directory
    ringcomm picks itself is replaced instead: tests/collectives/test_rundir.py)."""
    chosen = tmp_path / "run"
    chosen.mkdir(mode=0o755)
    os.chmod(chosen, 0o755)
    monkeypatch.setenv("RINGCOMM_RUN_DIR", str(chosen))
    with pytest.raises(Exception, match="is not a private directory of this user"):
        rundir.path()


STRANGER = textwrap.dedent("""
    import socket, sys
    kind, address, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    held, refused = [], 0
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX if kind == "ipc" else socket.AF_INET)
        try:
            s.connect(address if kind == "ipc" else ("127.0.0.1", int(address.rsplit(":", 1)[1])))
            held.append(s)
        except OSError:
            refused += 1
            s.close()
    print(len(held), refused, flush=True)
    sys.stdin.read()  # hold every connection until the test is done
""")


def _drop_to_nobody():
    os.setgid(65534)
    os.setuid(65534)


def python_for_another_user():
    """A Python interpreter that user nobody may run (this one may sit in root's home)."""
    if os.getuid() != 0:
        pytest.skip("needs root to run the stranger as another user (nobody)")
    for candidate in (os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3"):
        try:
            if candidate and subprocess.run([candidate, "-c", "pass"], preexec_fn=_drop_to_nobody,
                                            cwd="/", capture_output=True).returncode == 0:
                return candidate
        except OSError:  # not executable for nobody
            continue
    pytest.skip("no Python interpreter that user nobody may run")


@pytest.fixture(scope="module")
def low_limit_pool():
    """Ranks that start with a soft open-file limit of 1024 (a common default)."""
    pool = RankPool(2, env={"RINGCOMM_TRANSPORT": "tcp", "TEST_SOFT_NOFILE": "1024"})
    yield pool
    pool.close()


def open_file_limit(comm):
    import resource
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def test_ranks_raise_their_open_file_limit(low_limit_pool):
    for soft, hard in low_limit_pool.run(open_file_limit):
        assert soft == hard or soft >= 1 << 20, (soft, hard)


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_a_flood_of_connections_from_another_user_degrades_nothing(pools, low_limit_pool, kind):
    """Another local user opening 1,500 connections to a rank's socket: the private ipc
    directory refuses every one; over TCP they are held, yet the job runs on (the ranks raised
    their open-file limit, and unproven connections are dropped after the handshake limit)."""
    pool = low_limit_pool if kind == "tcp" else pools(2)
    (local, _), _ = pool.run(endpoints)
    address = local[kind][len(f"{kind}://"):]
    stranger = subprocess.Popen([python_for_another_user(), "-c", STRANGER, kind, address, "1500"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                preexec_fn=_drop_to_nobody, cwd="/")
    try:
        held, refused = map(int, stranger.stdout.readline().split())
        if kind == "ipc":
            assert (held, refused) == (0, 1500)
        else:
            assert held == 1500
        for _ in range(3):
            (ok0, _), (ok1, _) = pool.run(rejected_after_sum)
            assert ok0 and ok1
    finally:
        stranger.communicate("", timeout=10)


ONE_HOST = JOIN + textwrap.dedent("""
    from ringcomm.secret import derived
    guard = comm._engine.session.wire._guard
    print("derived", guard.secret == derived("127.0.0.1", int(__import__("os").environ["MASTER_PORT"])))
""")


def test_one_host_job_without_a_secret_agrees_on_a_private_random_one():
    """Ranks started by one launcher process (here: this test) with no RINGCOMM_SECRET share a
    fresh random secret through the private run directory; the file is gone once all joined."""
    before = {n for n in os.listdir(rundir.path()) if n.startswith("secret-")}
    results = spawn_job(ONE_HOST, 3, env={"RINGCOMM_SECRET": ""}, timeout=40)
    for code, out, err in results:
        assert code == 0 and "sum 6.0" in out and "derived False" in out, err
    after = {n for n in os.listdir(rundir.path()) if n.startswith("secret-")}
    assert after <= before


def test_ranks_of_different_launchers_need_a_secret():
    """Without RINGCOMM_SECRET, ranks that no single launcher started cannot share one: the
    rank that waits says what to set."""
    port = free_port()
    script = JOIN.replace("ringcomm.init()", "ringcomm.init(timeout=3)")
    rank0 = start_rank(0, 2, port, script, RINGCOMM_SECRET="")
    env = dict(os.environ, **job_env(1, 2, port, {"RINGCOMM_SECRET": ""}))
    via = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[1]]))"
    rank1 = subprocess.Popen([sys.executable, "-c", via, script], env=env,  # another parent
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = finish([rank0, rank1])
    assert all(code != 0 for code, _, _ in results)
    assert "no job secret from local rank 0" in results[1][2] and "RINGCOMM_SECRET" in results[1][2]


def test_ranks_on_several_hosts_need_a_secret():
    script = JOIN.replace("ringcomm.init()", "ringcomm.init(timeout=5)")
    refused = spawn_job(script, 2, env={"RINGCOMM_SECRET": "", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"},
                        timeout=30)
    for code, _, err in refused:
        assert code != 0 and "RINGCOMM_SECRET_FILE" in err and "RINGCOMM_INSECURE" in err, err
    allowed = spawn_job(JOIN, 2, env={"RINGCOMM_SECRET": "", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                      "RINGCOMM_INSECURE": "1"}, timeout=40)
    for code, out, err in allowed:
        assert code == 0 and "sum 3.0" in out and "RINGCOMM_INSECURE=1" in err, err
