"""Exact resume: S uninterrupted steps and (k steps, checkpoint, resume to S) end with
bitwise-identical parameters and the same losses, for every strategy in fp32 and fp16 (with a
loss scaler busy overflowing, skipping and rescaling, so its state must survive too)."""
import os

import pytest

from ckpt_helpers import STRATEGIES, run_train, steps_on_disk

pytestmark = pytest.mark.timeout(120)

K = 5  # stop after 5 of 8 steps: checkpoints at 2, 4 and 5 (the final one); 4 and 5 kept


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("strategy,offload,n", STRATEGIES,
                         ids=[f"{s}{'-offload' if o else ''}-{n}" for s, o, n in STRATEGIES])
def test_resume_is_bitwise_exact(pools, tmp_path, strategy, offload, n, precision):
    run = dict(strategy=strategy, offload=offload, precision=precision)
    ckpt = str(tmp_path / "ckpt")
    reference = pools(n).run(run_train, run)

    first = pools(n).run(run_train, dict(run, steps=K, checkpoint_dir=ckpt, checkpoint_every=2))
    assert steps_on_disk(ckpt) == [4, 5]
    assert sorted(os.listdir(os.path.join(ckpt, "step_000005"))) == \
        ["manifest.json"] + [f"rank{r}.npz" for r in range(n)]
    assert first[0]["param_sha256"] != reference[0]["param_sha256"]

    resumed = pools(n).run(run_train, dict(run, checkpoint_dir=ckpt, checkpoint_every=2, resume=True))
    for rank in range(n):  # the document is the same on every rank
        assert resumed[rank]["resumed_from_step"] == K
        assert resumed[rank]["param_sha256"] == reference[0]["param_sha256"]
        # the resumed steps' losses are recomputed, the first K come from the checkpoint
        assert resumed[rank]["losses"] == reference[0]["losses"]
        assert resumed[rank]["steps"] == reference[0]["steps"] == 8
        assert (resumed[rank]["loss_scale"], resumed[rank]["skipped_steps"]) == \
            (reference[0]["loss_scale"], reference[0]["skipped_steps"])
    if precision == "fp16":
        assert reference[0]["skipped_steps"] > 0  # the scaler really had state to restore
    assert steps_on_disk(ckpt) == [6, 8]


def test_resume_without_checkpoint_starts_fresh(pools, tmp_path):
    ckpt = str(tmp_path / "empty")
    reference = pools(2).run(run_train, dict(strategy="zero2"))[0]
    result = pools(2).run(run_train, dict(strategy="zero2", checkpoint_dir=ckpt, resume=True))[0]
    assert result["resumed_from_step"] is None
    assert result["param_sha256"] == reference["param_sha256"]
    assert steps_on_disk(ckpt) == [8]  # only the final checkpoint (--checkpoint-every 0)


def test_resume_at_the_last_step_runs_nothing(pools, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    done = pools(2).run(run_train, dict(strategy="zero3", checkpoint_dir=ckpt))[0]
    again = pools(2).run(run_train, dict(strategy="zero3", checkpoint_dir=ckpt, resume=True))[0]
    assert again["resumed_from_step"] == 8
    assert (again["param_sha256"], again["losses"]) == (done["param_sha256"], done["losses"])


@pytest.mark.parametrize("settings", [dict(optimizer="sgd", weight_decay=1e-2, clip_grad_norm=0.5),
                                      dict(optimizer="adam", weight_decay=1e-3, clip_grad_norm=0.05,
                                           overlap=False)], ids=["sgd-clip", "adam-clip-no-overlap"])
def test_resume_other_settings(pools, tmp_path, settings):
    run = dict(settings, strategy="zero2", precision="fp16")
    ckpt = str(tmp_path / "ckpt")
    reference = pools(2).run(run_train, run)[0]
    pools(2).run(run_train, dict(run, steps=3, checkpoint_dir=ckpt))
    resumed = pools(2).run(run_train, dict(run, checkpoint_dir=ckpt, resume=True))[0]
    assert resumed["resumed_from_step"] == 3
    assert (resumed["param_sha256"], resumed["losses"]) == (reference["param_sha256"], reference["losses"])
