"""Fixtures of the unit tests: the kernels' PTX (tests/unit/test_kernels*.py)."""
import concurrent.futures

import pytest

from kernel_helpers import KERNEL_DIR, NVCC, _compile
from ringcomm import kernels


@pytest.fixture(scope="session")
def ptx(tmp_path_factory):
    """{source name: PTX} of every source, compiled once per session."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH nor at /usr/local/cuda/bin/nvcc")
    tmp = tmp_path_factory.mktemp("ptx")
    jobs = {name: KERNEL_DIR / f"{name}.cu" for name in kernels.SOURCES}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(_compile, NVCC, src, tmp / f"{name}.ptx") for name, src in jobs.items()}
        results = {key: f.result() for key, f in futures.items()}
    failed = {key: log for key, (rc, log) in results.items() if rc != 0}
    assert not failed, "nvcc failed:\n" + "\n".join(f"{k}: {log}" for k, log in failed.items())
    for key, (_rc, log) in results.items():
        assert "warning" not in log.lower(), f"nvcc warns on {key}: {log}"
    return {name: (tmp / f"{name}.ptx").read_text() for name in jobs}
