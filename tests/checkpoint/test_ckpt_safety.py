"""Checkpoints are never lost silently: a fresh run refuses a directory that holds
checkpoints (unless ``--overwrite``), ``--resume`` with none intact fails listing them and
changes nothing, a damaged checkpoint is reported by name and moved aside, never deleted."""
import os
import subprocess
import sys

import pytest

from ckpt_helpers import BASE, run_train, steps_on_disk, subprocess_env
from ringcomm.train.checkpoint import files

pytestmark = pytest.mark.timeout(120)

RUN = dict(strategy="zero2", precision="fp32")


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def listing(root):
    return sorted(os.listdir(root)), {d: sorted(os.listdir(root / d)) for d in os.listdir(root)}


def test_a_fresh_run_refuses_a_directory_with_checkpoints_unless_overwrite(pools, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = pools(2).run(run_train, dict(RUN, steps=4, checkpoint_dir=str(ckpt), checkpoint_every=2))[0]
    before = listing(ckpt)
    with pytest.raises(AssertionError, match=r"already holds checkpoints \(step_000002, step_000004\): "
                                             r"--resume to continue from them, or --overwrite"):
        pools(2).run(run_train, dict(RUN, checkpoint_dir=str(ckpt)))
    assert listing(ckpt) == before  # nothing touched
    second = pools(2).run(run_train, dict(RUN, steps=3, checkpoint_dir=str(ckpt), overwrite=True))[0]
    assert steps_on_disk(str(ckpt)) == [3]  # the old run's checkpoints are replaced, as asked
    assert second["resumed_from_step"] is None and second["losses"] == first["losses"][:3]


def test_resume_with_every_checkpoint_damaged_fails_listing_them(pools, tmp_path):
    ckpt = tmp_path / "ckpt"
    pools(2).run(run_train, dict(RUN, steps=6, checkpoint_dir=str(ckpt), checkpoint_every=2))
    for step in (4, 6):
        flip_a_byte(ckpt / f"step_{step:06d}" / "rank1.npz")
    before = listing(ckpt)
    with pytest.raises(AssertionError, match=r"holds checkpoints but none is complete and intact \("
                                             r"step_000006: rank1.npz does not match its sha256; "
                                             r"step_000004: rank1.npz does not match its sha256\)"):
        pools(2).run(run_train, dict(RUN, checkpoint_dir=str(ckpt), resume=True))
    assert listing(ckpt) == before  # nothing moved, nothing deleted


def test_damaged_newest_is_moved_aside_and_the_older_one_resumed_saying_so(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--strategy", "zero2", "--layers", ",".join(map(str, BASE["layers"])), "--batch-size",
            BASE["batch_size"], "--samples", BASE["samples"], "--lr", BASE["lr"], "--seed", BASE["seed"],
            "--checkpoint-dir", ckpt, "--checkpoint-every", 2]

    def launch(*extra):
        proc = subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", "2", "-m", "ringcomm.train",
                               *map(str, args), *map(str, extra)], env=subprocess_env(), capture_output=True, text=True,
                              timeout=90)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    launch("--steps", 6)
    flip_a_byte(ckpt / "step_000006" / "rank0.npz")
    damaged = (ckpt / "step_000006" / "rank0.npz").read_bytes()
    log = launch("--steps", 8, "--resume")
    assert f"resuming from {ckpt}/step_000004 (step 4)" in log, log
    assert (f"skipped damaged checkpoint {ckpt}/step_000006 (rank0.npz does not match its sha256); "
            f"moved it to {ckpt}/damaged/step_000006") in log, log
    assert (ckpt / "damaged" / "step_000006" / "rank0.npz").read_bytes() == damaged  # kept, as it was
    assert steps_on_disk(str(ckpt)) == [6, 8]


def test_prune_moves_a_damaged_older_checkpoint_aside(pools, tmp_path):
    ckpt = tmp_path / "ckpt"
    pools(2).run(run_train, dict(RUN, steps=4, checkpoint_dir=str(ckpt), checkpoint_every=2))
    flip_a_byte(ckpt / "step_000002" / "rank1.npz")
    os.makedirs(ckpt / "step_000003")  # an unfinished write: never a checkpoint
    lines = files.prune(str(ckpt), 4)
    assert steps_on_disk(str(ckpt)) == [4]
    assert sorted(os.listdir(ckpt / "damaged")) == ["step_000002"]
    assert any("moved damaged checkpoint" in line and "step_000002" in line for line in lines)
    assert any("removed" in line and "step_000003" in line and "never finished" in line for line in lines)


def test_only_unfinished_writes_resume_as_a_fresh_start(pools, tmp_path):
    """A job killed while writing its first checkpoint left a directory without a manifest:
    never a checkpoint, so --resume (and a launcher restart) starts from step 0."""
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt / "step_000004")
    (ckpt / "step_000004" / "rank0.npz").write_bytes(b"partial")
    result = pools(2).run(run_train, dict(RUN, checkpoint_dir=str(ckpt), resume=True))[0]
    assert result["resumed_from_step"] is None
    assert steps_on_disk(str(ckpt)) == [8]


def test_a_malformed_manifest_is_damage_not_a_crash(tmp_path):
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt / "step_000002")
    (ckpt / "step_000002" / "manifest.json").write_text(
        '{"format": "ringcomm-checkpoint", "version": 1, "step": 2, "world_size": 1, "files": {"rank0.npz": {}}}')
    (ckpt / "step_000002" / "rank0.npz").write_bytes(b"x")
    entry, damaged, unfinished = files.find_resumable(str(ckpt))
    assert entry is None and not unfinished and "malformed manifest" in damaged[0].reason
    os.makedirs(ckpt / "step_000004")
    (ckpt / "step_000004" / files.MANIFEST).write_text("[1, 2]")  # valid JSON, not a manifest
    assert "not a ringcomm-checkpoint" in files.verify(str(ckpt / "step_000004"))[1]
