"""glibc's malloc tuning: ringcomm.init() applies it in every process, a one-process job too,
so that freed large buffers (messages, a training step's arrays) are reused instead of
faulted in afresh."""
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

# after init(): a training step's pattern of large arrays, allocated, written and freed over
# and over; the page faults of the last rounds are what a steady step pays
PROBE = """
import json, resource
import numpy as np
import ringcomm
from ringcomm.transport import tuning
comm = ringcomm.init()
sizes = [3 << 20, 9 << 20, 40 << 20]  # 40 MiB: above glibc's largest automatic mmap threshold
def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt  # this thread's: not the engine's
for i in range(6):
    a = np.ones(sizes[i % 3] // 4, np.float32); del a
before = faults()
for i in range(9):
    a = np.ones(sizes[i % 3] // 4, np.float32); del a
print(json.dumps({"tuned": tuning.mmap_threshold is not None, "threshold": tuning.mmap_threshold, "faults": faults() - before}))
comm.close()
"""


def _probe(**extra):
    # a bare environment: no launcher's variables (a job of one process), no other allocator
    # (LD_PRELOAD) or malloc settings (GLIBC_TUNABLES, MALLOC_*) from the caller
    env = {k: os.environ[k] for k in ("PATH", "HOME", "PYTHONPATH", "TMPDIR") if k in os.environ}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra}, capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _numa_balancing():
    path = Path("/proc/sys/kernel/numa_balancing")  # its hinting faults count as minor faults
    return path.exists() and path.read_text().strip() not in ("", "0")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
@pytest.mark.skipif(_numa_balancing(), reason="NUMA balancing's hinting faults count as page faults")
def test_init_tunes_malloc_in_a_one_process_job_and_freed_arrays_are_reused():
    tuned, untuned = _probe(), _probe(RINGCOMM_MALLOC_TUNING="0")
    assert tuned["tuned"] is True and untuned["tuned"] is False
    if tuned["threshold"] < 40 << 20:
        pytest.skip(f"this glibc takes an mmap threshold of {tuned['threshold']} bytes at most")
    # each 40 MiB array mapped afresh: at least its 2 MiB huge pages faulted in (numpy asks
    # for huge pages for large arrays), 3 arrays; reused, no page at all
    assert untuned["faults"] >= 3 * 20 * 0.9, untuned
    assert tuned["faults"] <= 8, tuned
