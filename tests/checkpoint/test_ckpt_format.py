"""The checkpoint format: what each rank file and the manifest hold, hashes, no pickle, only
the last two kept, and ``python -m ringcomm.checkpoint consolidate|list``."""
import hashlib
import os

import numpy as np
import pytest

from ckpt_helpers import BASE, cli, load_params, manifest, run_train, steps_on_disk
from ringcomm.train.checkpoint.cli import consolidate
from ringcomm.train.parallel.flat import Layout
from ringcomm.train.models.mlp import param_specs

pytestmark = pytest.mark.timeout(120)


def test_rank_files_and_manifest(pools, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pools(2).run(run_train, dict(strategy="zero2", precision="fp16", steps=3, checkpoint_dir=ckpt,
                                 checkpoint_every=1))
    assert steps_on_disk(ckpt) == [2, 3]  # every step saved, the last two kept
    path = os.path.join(ckpt, "step_000003")
    m = manifest(path)
    assert (m["format"], m["step"], m["strategy"], m["world_size"], m["precision"], m["kind"]) == \
        ("ringcomm-checkpoint", 3, "zero2", 2, "fp16", "shard")
    assert m["layers"] == list(BASE["layers"]) and m["num_params"] == 1461
    layout = Layout(param_specs(BASE["layers"]), 2, int(BASE["bucket_mb"] * 2 ** 20), 2)
    assert [(u["start"], u["length"], u["padded"], u["shard_size"]) for u in m["layout"]["units"]] == \
        [(u.start, u.length, u.padded, u.shard_size) for u in layout.units]
    assert len(layout.units) == 2 and any(u.padded != u.length for u in layout.units)
    for rank in range(2):
        name = f"rank{rank}.npz"
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        assert m["files"][name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        with np.load(os.path.join(path, name), allow_pickle=False) as z:  # plain arrays only
            arrays = {k: z[k] for k in z.files}
        assert all(a.dtype != object for a in arrays.values())
        assert arrays["master"].dtype == np.float32 and arrays["master"].shape == (layout.shard_total,)
        assert arrays["m"].shape == arrays["v"].shape == (layout.shard_total,)
        assert int(arrays["step"]) == 3 and int(arrays["rank"]) == rank and len(arrays["losses"]) == 3
        assert int(arrays["seed"]) == BASE["seed"] and float(arrays["scaler_scale"]) > 0
    assert not [f for f in os.listdir(path) if ".tmp" in f]  # no temporary file left


@pytest.mark.parametrize("strategy,n,precision", [("zero3", 2, "fp16"), ("zero2", 3, "fp32"),
                                                  ("zero1", 2, "fp32"), ("ddp", 2, "fp16"),
                                                  ("dp", 2, "fp16"), ("single", 1, "fp32")])
def test_consolidate_equals_save(pools, tmp_path, strategy, n, precision):
    ckpt, saved = str(tmp_path / "ckpt"), str(tmp_path / "saved.npz")
    pools(n).run(run_train, dict(strategy=strategy, precision=precision, checkpoint_dir=ckpt,
                                 checkpoint_every=3, save=saved))
    out = tmp_path / "consolidated.npz"
    entry = consolidate(ckpt, str(out))  # the newest complete one: step 8
    assert entry.step == 8
    want, got = load_params(saved), load_params(out)
    assert list(got) == ["W0", "b0", "W1", "b1", "W2", "b2"] == list(want)
    for name in want:
        assert got[name].dtype == np.float32 and got[name].shape == want[name].shape
        assert np.array_equal(got[name], want[name]), name


def test_cli_consolidate_and_list(pools, tmp_path):
    ckpt = tmp_path / "ckpt"
    pools(2).run(run_train, dict(strategy="zero3", steps=4, checkpoint_dir=str(ckpt), checkpoint_every=2))
    os.makedirs(ckpt / "step_000006")  # a crashed write: a rank file, no manifest
    (ckpt / "step_000006" / "rank0.npz").write_bytes(b"partial")

    rc, out, err = cli("consolidate", ckpt / "step_000002", tmp_path / "two.npz")
    assert rc == 0, err
    rc, out, err = cli("consolidate", ckpt, tmp_path / "newest.npz")
    assert rc == 0 and "step 4" in out and "zero3 on 2 rank(s)" in out, out + err
    two, newest = load_params(tmp_path / "two.npz"), load_params(tmp_path / "newest.npz")
    assert not np.array_equal(two["W0"], newest["W0"])

    rc, out, err = cli("list", ckpt)
    assert rc == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"2", "4", "6"}
    assert "complete" in rows["4"] and "zero3" in rows["4"] and " 2 " in rows["4"]
    assert "incomplete (no manifest)" in rows["6"]

    rc, out, err = cli("consolidate", ckpt / "step_000006", tmp_path / "bad.npz")
    assert rc == 1 and "no complete checkpoint" in err
    rc, out, err = cli("consolidate", tmp_path / "nothing", tmp_path / "bad.npz")
    assert rc == 1 and not os.path.exists(tmp_path / "bad.npz")
