"""Resuming on another world size (or strategy) reshards: the full fp32 master and Adam state
are rebuilt in model order and cut under the new layout. Loading is exact (a checkpoint
re-saved by the new world holds the same state); training on continues as an uninterrupted
run on the new world does, up to floating-point summation order."""
import numpy as np
import pytest

from ckpt_helpers import load_params, run_resume_and_save, run_train
from ringcomm.train.checkpoint import files, state

pytestmark = pytest.mark.timeout(120)

K = 3
CASES = [  # (strategy, N) -> (strategy, M), precision
    ("zero2", 4, "zero2", 2, "fp32"),
    ("ddp", 2, "ddp", 3, "fp32"),
    ("zero3", 2, "zero3", 4, "fp32"),
    ("zero2", 4, "zero2", 2, "fp16"),
    ("zero3", 2, "ddp", 3, "fp16"),
    ("dp", 2, "zero1", 3, "fp32"),
]
# fp32: only the order of the gradient sums differs (~1e-7 seen); fp16 also rounds activations
# and gradients to half precision after those sums (~1e-4 seen)
RTOL = {"fp32": 1e-5, "fp16": 2e-3}


@pytest.mark.parametrize("old,n,new,m,precision", CASES,
                         ids=[f"{a}{n}-{b}{m}-{p}" for a, n, b, m, p in CASES])
def test_reshard(pools, tmp_path, old, n, new, m, precision):
    ckpt, again = str(tmp_path / "ckpt"), str(tmp_path / "again")
    first = pools(n).run(run_train, dict(strategy=old, precision=precision, steps=K, checkpoint_dir=ckpt))[0]

    # loading is exact: re-saved on the new world, the state is bit for bit the old one
    sha = pools(m).run(run_resume_and_save, dict(strategy=new, precision=precision, steps=K,
                                                 checkpoint_dir=ckpt, resume=True), again)[0]
    assert sha == first["param_sha256"]
    before, after = (state.read_full(files.resolve(d)) for d in (ckpt, again))
    assert after.manifest["world_size"] == m and after.manifest["strategy"] == new
    for key in ("params", "m", "v"):
        assert all(np.array_equal(a, b) for a, b in zip(getattr(before, key), getattr(after, key), strict=True)), key
        assert before.flat(key).shape == (1461,)  # flat, unpadded, model order
    assert before.t == after.t
    assert {k: float(v) for k, v in before.scaler.items()} == {k: float(v) for k, v in after.scaler.items()}
    assert np.array_equal(before.losses, after.losses)

    # K steps on N ranks, then the rest on M, against all steps on M
    resumed = pools(m).run(run_train, dict(strategy=new, precision=precision, checkpoint_dir=ckpt,
                                           resume=True, save=str(tmp_path / "resumed.npz")))[0]
    reference = pools(m).run(run_train, dict(strategy=new, precision=precision,
                                             save=str(tmp_path / "reference.npz")))[0]
    assert resumed["resumed_from_step"] == K and resumed["losses"][:K] == first["losses"]
    np.testing.assert_allclose(resumed["losses"], reference["losses"], rtol=RTOL[precision] / 10)
    got, want = load_params(tmp_path / "resumed.npz"), load_params(tmp_path / "reference.npz")
    for name in want:
        scale = np.abs(want[name]).max()
        assert np.abs(got[name] - want[name]).max() <= RTOL[precision] * scale, name
    assert resumed["skipped_steps"] == reference["skipped_steps"]


def test_incompatible_checkpoint_is_refused(pools, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pools(2).run(run_train, dict(strategy="zero2", steps=2, checkpoint_dir=ckpt))
    with pytest.raises(AssertionError, match="the checkpoint has precision fp32 but this run has fp16"):
        pools(2).run(run_train, dict(strategy="zero2", precision="fp16", checkpoint_dir=ckpt, resume=True))
    with pytest.raises(AssertionError, match=r"the checkpoint has layers \[16, 32, 24, 5\]"):
        pools(2).run(run_train, dict(strategy="zero2", layers=(16, 8, 5), checkpoint_dir=ckpt, resume=True))
