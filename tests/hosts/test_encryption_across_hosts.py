"""Between hosts, traffic is encrypted by default and strangers stay out: a job of two
emulated hosts (network namespaces), one rank each. While it runs, a packet capture records
both ranks' links; a stranger on the second host who knows rank 0's address and port but
not the secret tries to join the rendezvous and to connect and inject frames (tests/hosts/
stranger.py). The capture must not hold the payload or the secret in clear, and nothing
the stranger sent may reach the rank. With ``RINGCOMM_ENCRYPT=0`` the payload shows in the
capture: the check can fail."""
import json
import os
import secrets
import subprocess
import sys
import time

import pytest

import netns  # bench/netns.py, put on the path by conftest.py
from conftest import REPO

pytestmark = pytest.mark.timeout(150)
HERE = os.path.dirname(os.path.abspath(__file__))
MARKER = b"RINGCOMM-PAYLOAD-IN-CLEAR:"
PORT = 29783


def capture(cluster, rank, out):
    proc = subprocess.Popen(["ip", "netns", "exec", cluster.bridge, sys.executable,
                             os.path.join(HERE, "capture.py"), f"p{rank}", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening", proc.stderr.read()
    return proc


def wait_for(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("cluster", [(2, 1)], indirect=True, ids=["2x1"])
@pytest.mark.parametrize("encrypt", ["default", "0"])
def test_strangers_and_eavesdroppers_get_nothing(cluster, tmp_path, encrypt):
    secret = secrets.token_hex(16)
    extra = {"PYTHONPATH": REPO, "RINGCOMM_TIMEOUT": "30"}
    if encrypt != "default":
        extra["RINGCOMM_ENCRYPT"] = encrypt
    intruder_env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                        MASTER_ADDR=cluster.addr(0), MASTER_PORT=str(PORT), RINGCOMM_SECRET=secrets.token_hex(16),
                        RINGCOMM_TIMEOUT="6", PYTHONPATH=REPO)
    captures = []
    try:
        captures += [capture(cluster, r, tmp_path / f"link{r}.raw") for r in range(2)]
        intruder = netns.spawn(cluster, 1, [sys.executable, "-c", "import ringcomm; ringcomm.init()"], intruder_env)
        time.sleep(0.5)  # as a rule the intruder is at the rendezvous before the real rank 1
        job = netns.launch(cluster, [os.path.join(HERE, "secure_worker.py"), str(tmp_path)], PORT, secret, **extra)
        wait_for(tmp_path / "address")
        address = json.loads((tmp_path / "address").read_text())
        stranger = netns.spawn(cluster, 1, [sys.executable, os.path.join(HERE, "stranger.py"), address["tcp"]],
                               dict(os.environ, PYTHONPATH=REPO))
        said, _ = stranger.communicate(timeout=30)
        assert stranger.returncode == 0, said
        (tmp_path / "go").touch()
        for out, rc in netns.finish(job, 90):
            assert rc == 0, out[-3000:]
        said, _ = intruder.communicate(timeout=30)
        assert intruder.returncode != 0, said  # refused at the rendezvous, or found it closed
    finally:
        for proc in captures:
            proc.terminate()
            proc.wait(10)
    result = json.loads((tmp_path / "result").read_text())
    assert result["ok"] and result["rejected"] == address["rejected"], result  # nothing got in
    assert result["encrypted"] == (encrypt == "default")
    seen = b"".join((tmp_path / f"link{r}.raw").read_bytes() for r in range(2))
    assert len(seen) > len(MARKER) << 12, "the capture recorded less than the payload"
    assert secret.encode() not in seen and bytes.fromhex(secret) not in seen
    assert (MARKER in seen) == (encrypt == "0")
