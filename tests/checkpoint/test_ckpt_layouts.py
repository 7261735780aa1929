"""Checkpoints on model-parallel layouts: resuming on the same layout is bitwise exact, and a
checkpoint saved on one layout resumes on another (every parameter is assembled by name from
the tensor-parallel pieces and pipeline stages, then cut again)."""
import dataclasses

import numpy as np
import pytest

from ckpt_helpers import cli
from ringcomm.train.checkpoint import files, state
from ringcomm.train.config import TrainConfig
from ringcomm.train.trainer import train

pytestmark = pytest.mark.timeout(180)

GPT = TrainConfig(model="gpt", n_layer=2, n_head=4, d_model=16, seq_len=16, batch_size=8, steps=4,
                  optimizer="sgd", lr=0.5, seed=2, strategy="ddp", log_every=100)
MLP = TrainConfig(layers=(16, 32, 24, 5), batch_size=48, samples=480, steps=4, lr=5e-3, seed=3,
                  bucket_mb=0.001, log_every=100, optimizer="sgd")


@pytest.fixture(scope="module")
def tokens(token_file):
    return token_file(16)


def run(comm, base, changes):
    doc, _ = train(comm, dataclasses.replace(base, **changes), out=lambda *a: None)
    return {k: doc[k] for k in ("param_sha256", "losses", "resumed_from_step", "skipped_steps")}


SAME = [dict(dp=2, cp=2, strategy="zero2", precision="fp16", optimizer="adam", lr=3e-3),
        dict(pp=2, tp=2, sp=True, micro_batches=2), dict(cp=2, tp=2, strategy="zero3", offload=True),
        dict(dp=2, pp=2, strategy="zero1", optimizer="adam", lr=3e-3), dict(dp=2, tp=2, strategy="dp")]


@pytest.mark.parametrize("layout", SAME, ids=[",".join(f"{k}{v}" for k, v in s.items()) for s in SAME])
def test_resume_on_the_same_layout_is_bitwise_exact(pools, tokens, tmp_path, layout):
    ckpt = str(tmp_path / "ckpt")
    whole = pools(4).run(run, GPT, dict(data=tokens, **layout))[0]
    pools(4).run(run, GPT, dict(data=tokens, steps=2, checkpoint_dir=ckpt, **layout))
    resumed = pools(4).run(run, GPT, dict(data=tokens, checkpoint_dir=ckpt, resume=True, **layout))[0]
    assert resumed["resumed_from_step"] == 2
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["losses"] == whole["losses"]


RESHARD = [  # (base, world, layout saved) -> (world, layout resumed)
    ("gpt", 4, dict(dp=4), 4, dict(dp=2, tp=2)),
    ("gpt", 4, dict(cp=2, tp=2), 1, dict(strategy="single")),
    ("gpt", 4, dict(pp=2, tp=2, sp=True), 4, dict(dp=2, cp=2, strategy="zero3")),
    ("gpt", 2, dict(dp=2, strategy="zero2"), 4, dict(pp=4)),
    ("mlp", 4, dict(pp=2, tp=2), 4, dict(dp=4, strategy="zero2")),
    ("mlp", 2, dict(strategy="ddp"), 4, dict(tp=2, pp=2, micro_batches=2)),
]


@pytest.mark.parametrize("case", RESHARD, ids=[f"{c[0]}-" + ",".join(f"{k}{v}" for k, v in c[2].items()) + "-to-"
                                               + ",".join(f"{k}{v}" for k, v in c[4].items()) for c in RESHARD])
def test_checkpoint_resumes_on_another_layout(pools, tokens, tmp_path, case):
    kind, n, saved_layout, m, layout = case
    base = dataclasses.replace(GPT, data=tokens) if kind == "gpt" else MLP
    ckpt = str(tmp_path / "ckpt")
    first = pools(n).run(run, base, dict(steps=2, checkpoint_dir=ckpt, **saved_layout))[0]
    before = state.read_full(files.resolve(ckpt))
    resumed = pools(m).run(run, base, dict(checkpoint_dir=ckpt, resume=True, save=str(tmp_path / "r.npz"), **layout))[0]
    reference = pools(m).run(run, base, dict(save=str(tmp_path / "w.npz"), **layout))[0]
    assert resumed["resumed_from_step"] == 2 and resumed["losses"][:2] == first["losses"]
    np.testing.assert_allclose(resumed["losses"], reference["losses"], rtol=1e-5)
    got, want = np.load(tmp_path / "r.npz"), np.load(tmp_path / "w.npz")
    assert got.files == want.files == before.names()
    for name in want.files:
        assert np.abs(got[name] - want[name]).max() <= 1e-5 * np.abs(want[name]).max(), name
    after = state.read_full(files.resolve(ckpt))  # the resumed run saved step 4
    assert after.manifest["step"] == 4 and after.manifest["world_size"] == m
    assert [p.shape for p in after.params] == [p.shape for p in before.params]


def test_consolidate_assembles_tensor_parallel_pieces_and_stages(pools, tokens, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pools(4).run(run, GPT, dict(data=tokens, pp=2, tp=2, checkpoint_dir=ckpt, save=str(tmp_path / "s.npz")))
    rc, out, err = cli("consolidate", ckpt, tmp_path / "c.npz")
    assert rc == 0 and "of the gpt" in out and "'d_model': 16" in out, out + err
    got, want = np.load(tmp_path / "c.npz"), np.load(tmp_path / "s.npz")
    assert got.files == want.files and got.files[:2] == ["wte", "wpe"]
    for name in want.files:
        assert np.array_equal(got[name], want[name]), name


def test_a_gpt_checkpoint_refuses_another_model(pools, tokens, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pools(2).run(run, GPT, dict(data=tokens, steps=1, checkpoint_dir=ckpt, tp=2))
    with pytest.raises(AssertionError, match="the checkpoint has gpt .*'d_model': 16.* but this run has"):
        pools(2).run(run, GPT, dict(data=tokens, steps=2, d_model=32, checkpoint_dir=ckpt, resume=True))
