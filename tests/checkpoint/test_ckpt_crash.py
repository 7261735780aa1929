"""Crash safety: a crash in the middle of writing a checkpoint, or a damaged checkpoint on
disk, leaves the previous one loadable; ``--resume`` takes the newest complete one and the run
still ends bitwise equal to an uninterrupted run."""
import os
from pathlib import Path

import pytest

from ckpt_helpers import cli, run_train, run_train_crashing, steps_on_disk
from ringcomm.train.checkpoint import files

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("victim", ["rank file", "manifest"])
def test_crash_while_writing(pools, tmp_path, victim):
    run = dict(strategy="zero3", precision="fp16")
    ckpt = str(tmp_path / "ckpt")
    reference = pools(2).run(run_train, run)[0]
    pools(2).run(run_train, dict(run, steps=6, checkpoint_dir=ckpt, checkpoint_every=2))
    assert steps_on_disk(ckpt) == [4, 6]

    with pytest.raises(AssertionError, match=r"rank [01] died"):  # the job died writing step 8
        pools(2).run(run_train_crashing, dict(run, checkpoint_dir=ckpt, checkpoint_every=2, resume=True), 8, victim)
    eight = os.path.join(ckpt, "step_000008")
    left = sorted(os.listdir(eight))
    if victim == "rank file":  # rank 0's file is durable, rank 1's is torn, no manifest
        assert left[0] == "rank0.npz" and left[1].startswith("rank1.npz.tmp-") and len(left) == 2
    else:  # every rank file is durable, the manifest is torn
        assert left[0].startswith("manifest.json.tmp-") and left[1:] == ["rank0.npz", "rank1.npz"]
    entries = {e.step: e for e in files.scan(ckpt)}
    assert entries[6].complete and not entries[8].complete and entries[8].reason == "no manifest"
    assert files.newest_complete(ckpt).step == 6

    resumed = pools(2).run(run_train, dict(run, checkpoint_dir=ckpt, checkpoint_every=2, resume=True))[0]
    assert resumed["resumed_from_step"] == 6
    assert resumed["param_sha256"] == reference["param_sha256"]
    assert resumed["losses"] == reference["losses"]
    assert steps_on_disk(ckpt) == [6, 8] and files.newest_complete(ckpt).step == 8
    assert not [f for f in os.listdir(eight) if ".tmp-" in f]  # the crashed writer's leftovers are gone


def test_damaged_checkpoint_is_skipped(pools, tmp_path):
    run = dict(strategy="zero2", precision="fp32")
    ckpt = tmp_path / "ckpt"
    reference = pools(2).run(run_train, run)[0]
    pools(2).run(run_train, dict(run, steps=6, checkpoint_dir=str(ckpt), checkpoint_every=2))
    damaged = ckpt / "step_000006" / "rank1.npz"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the manifest's hash no longer matches
    damaged.write_bytes(bytes(data))
    os.makedirs(ckpt / "step_000007")  # and a later directory that never got its files
    rc, out, _ = cli("list", ckpt)
    assert "incomplete (rank1.npz does not match its sha256)" in out and "incomplete (no manifest)" in out

    resumed = pools(2).run(run_train, dict(run, checkpoint_dir=str(ckpt), checkpoint_every=2, resume=True))[0]
    assert resumed["resumed_from_step"] == 4
    assert resumed["param_sha256"] == reference["param_sha256"]
    assert steps_on_disk(str(ckpt)) == [6, 8]


def test_write_durable(tmp_path, monkeypatch):
    path = str(tmp_path / "file.bin")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    files.write_durable(path, b"old")
    assert len(synced) == 2  # the file, then its directory
    assert Path(path).read_bytes() == b"old"

    def broken_fsync(fd):
        raise OSError("disk on fire")
    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk on fire"):
        files.write_durable(path, b"new")
    assert Path(path).read_bytes() == b"old"  # the old contents, whole
    assert os.listdir(tmp_path) == ["file.bin"]  # no temporary file left
