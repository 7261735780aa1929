"""Fixtures of the unit tests: the kernels' PTX (tests/unit/test_kernels*.py)."""
import concurrent.futures

import pytest

from kernel_helpers import KERNEL_DIR, NVCC, VARIANTS, _compile
from ringcomm import kernels


@pytest.fixture(scope="session")
def ptx(tmp_path_factory):
    """PTX of every source, as it is and with -DRINGCOMM_NO_CUDA_FP16 (no cuda_fp16.h),
    compiled once per session."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH nor at /usr/local/cuda/bin/nvcc")
    tmp = tmp_path_factory.mktemp("ptx")
    jobs = {(name, variant): (KERNEL_DIR / f"{name}.cu", () if variant == "file" else (kernels.NO_CUDA_FP16,))
            for name in kernels.SOURCES for variant in VARIANTS}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(_compile, NVCC, src, tmp / f"{key[0]}.{key[1]}.ptx", extra)
                   for key, (src, extra) in jobs.items()}
        results = {key: f.result() for key, f in futures.items()}
    failed = {key: log for key, (rc, log) in results.items() if rc != 0}
    assert not failed, "nvcc failed:\n" + "\n".join(f"{k}: {log}" for k, log in failed.items())
    for key, (rc, log) in results.items():
        assert "warning" not in log.lower(), f"nvcc warns on {key}: {log}"
    return {key: (tmp / f"{key[0]}.{key[1]}.ptx").read_text() for key in jobs}
