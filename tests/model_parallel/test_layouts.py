"""Tensor, pipeline and composed parallelism end with the same parameters as the single-
process reference; schedules, traffic and activation memory follow their formulas."""
import dataclasses

import numpy as np
import pytest

from harness import RankPool
from ringcomm.train.config import TrainConfig
from ringcomm.train.trainer import train
from ringcomm.train.parallel.step import schedule
from ringcomm.train.parallel.tensor import TPLayer

pytestmark = pytest.mark.timeout(120)

BASE = TrainConfig(strategy="ddp", steps=4, batch_size=48, samples=480, seed=5, layers=(12, 20, 16, 14, 5), lr=3e-3)


def run(comm, **changes):
    cfg = dataclasses.replace(BASE, **changes)
    document, strategy = train(comm, cfg, out=lambda *a: None)
    params = strategy.full_params() if strategy is not None else None
    return document, params


def reference(pools):
    document, params = pools(1).run(run, strategy="single")[0]
    return document, params


def model_parallel(comm, **layout):
    document, _ = train(comm, dataclasses.replace(BASE, **layout), out=lambda *a: None)
    return document


@pytest.fixture(scope="module")
def single(pools):
    return reference(pools)


LAYOUTS = [dict(dp=2, tp=2), dict(dp=2, tp=2, strategy="zero1"), dict(dp=2, pp=2, micro_batches=2, strategy="zero2"), dict(dp=2, pp=2, micro_batches=2), dict(pp=2, tp=2, micro_batches=3),
           dict(pp=4, micro_batches=4), dict(tp=4), dict(pp=2, micro_batches=4, schedule="gpipe"),
           dict(dp=1, pp=4, micro_batches=6, schedule="gpipe"), dict(tp=2, dp=2, optimizer="sgd", lr=0.05)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: ",".join(f"{k}{v}" for k, v in d.items()))
def test_layout_matches_single(pools, single, layout, tmp_path):
    ref_doc, ref_params = single if "optimizer" not in layout else pools(1).run(
        run, strategy="single", optimizer="sgd", lr=0.05)[0]
    path = str(tmp_path / "p.npz")
    docs = pools(4).run(model_parallel, save=path, **layout)
    saved = np.load(path)
    for k, name in enumerate(saved.files):
        err = np.abs(saved[name] - ref_params[k]).max() / np.abs(ref_params[k]).max()
        assert err < 1e-5, f"{name}: relative error {err}"
    assert np.allclose(docs[0]["losses"], ref_doc["losses"], rtol=1e-5)
    assert all(d["param_sha256"] == docs[0]["param_sha256"] for d in docs)
    assert docs[0]["layout"] == {"dp": layout.get("dp", 4 // (layout.get("pp", 1) * layout.get("tp", 1))),
                                 "cp": 1, "pp": layout.get("pp", 1), "tp": layout.get("tp", 1)}


def test_tensor_parallel_traffic_matches_formula(pools):
    docs = pools(4).run(model_parallel, tp=4)
    for row in docs[0]["per_rank"]:
        assert row["tp_bytes_predicted_per_step"] > 0
        # ring all-reduces of whole activation matrices: exact up to chunk rounding
        assert row["tp_bytes_sent_per_step"] == pytest.approx(row["tp_bytes_predicted_per_step"], rel=0.01)
        assert row["dp_bytes_sent_per_step"] == 0 and row["pp_bytes_sent_per_step"] == 0


def test_pipeline_activation_memory_1f1b_vs_gpipe(pools):
    """GPipe holds all M micro-batches' activations, 1F1B at most P − p on stage p, in what
    each schedule saves. (The step's peak as traced from the allocator shows the same on an
    idle machine, bench/pipeline.py measures it; on a busy one it also holds the boundary
    tensors a neighbour sent ahead, which the schedule does not decide, so it is not tested.)"""
    m, wide = 8, dict(layers=(12, 64, 64, 64, 5), batch_size=4096, samples=4096, steps=2)
    gpipe = pools(4).run(model_parallel, pp=4, micro_batches=m, schedule="gpipe", **wide)[0]
    onef = pools(4).run(model_parallel, pp=4, micro_batches=m, schedule="1f1b", **wide)[0]
    for g, o in zip(gpipe["per_rank"], onef["per_rank"], strict=True):
        saved_per_micro = g["saved_activation_bytes"] / m
        assert saved_per_micro > 0, g
        assert o["saved_activation_bytes"] <= (4 - g["p"]) * saved_per_micro + 1, (g["p"], o, g)
        assert g["bubble_formula"] == pytest.approx(3 / (m + 3))
    last = onef["per_rank"][3]["saved_activation_bytes"]
    assert last <= 0.125 * gpipe["per_rank"][3]["saved_activation_bytes"] + 1  # one micro-batch of 8
    assert gpipe["param_sha256"] == onef["param_sha256"]


@pytest.mark.parametrize("p,pp,m", [(0, 4, 8), (3, 4, 8), (1, 2, 1), (0, 4, 2)])
def test_1f1b_schedule_structure(p, pp, m):
    ops = schedule("1f1b", p, pp, m)
    assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
    alive = peak = 0
    for op, i in ops:
        assert op == "F" or ("F", i) in ops[:ops.index((op, i))], "backward before its forward"
        alive += 1 if op == "F" else -1
        peak = max(peak, alive)
    assert peak <= min(pp - p, m)
    gpipe = schedule("gpipe", p, pp, m)
    assert gpipe[:m] == [("F", i) for i in range(m)]


def test_tp_layer_split():
    col = TPLayer(0, 10, 7, tp=3, t=2, last=False)
    row = TPLayer(1, 7, 5, tp=3, t=2, last=False)
    assert (col.kind, col.cols, col.out_local) == ("column", slice(5, 7), 2)
    assert (row.kind, row.rows, row.in_local) == ("row", slice(5, 7), 2)
    assert row.owns_bias() is False and TPLayer(1, 7, 5, 3, 0, False).owns_bias()


def test_bad_layout_is_rejected(pools):
    assert "but the world has 4 ranks" in pools(4).run(bad_layout)[0]


def bad_layout(comm):
    try:
        train(comm, dataclasses.replace(BASE, pp=3, dp=1), out=lambda *a: None)
    except ValueError as exc:
        return str(exc)
    return "no error"


def wide_tp(comm):
    """Activations of 64 x 512 floats (128 KiB): past the 64 KiB small-message size, within
    the 1 MiB up to which `auto` picks recursive doubling among ranks of one host (on 4
    ranks it sends 2S where the ring sends 1.5S, so the formula must know which ran)."""
    doc = model_parallel(comm, tp=4, layers=(12, 512, 512, 5), batch_size=64, samples=128, steps=2)
    return comm.local, doc["per_rank"]


@pytest.mark.parametrize("shm", ["1", "0"])
def test_tp_traffic_follows_autos_choice_on_and_off_lanes(shm):
    pool = RankPool(4, env={"RINGCOMM_SHM": shm})
    try:
        results = pool.run(wide_tp)
    finally:
        pool.close()
    for local, per_rank in results:
        assert local is (shm == "1")
        for row in per_rank:
            assert row["tp_bytes_sent_per_step"] > 0
            assert row["tp_bytes_sent_per_step"] == pytest.approx(row["tp_bytes_predicted_per_step"], rel=0.01)
