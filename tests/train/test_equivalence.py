"""Every strategy computes the same model as ``single``.

With the same seed, data and global batch, dp, ddp (with and without overlap), zero1/2/3 and
zero1/2/3 with offload on N ∈ {2, 3, 4} ranks end with the parameters of the one-process
reference (fp32: max relative error ≤ 1e-5), with Adam and with SGD, and with clipping by
the global gradient norm. Ranks that hold full parameters hold bitwise-identical bytes.
fp16 runs follow the fp32 loss curve closely.
"""
import numpy as np
import pytest

from ringcomm.train.config import TrainConfig
from ringcomm.train.trainer import train
from ringcomm.train.data import BatchOrder, synthetic
from ringcomm.train.models.mlp import init_params, param_specs

pytestmark = pytest.mark.timeout(120)

LAYERS = (16, 32, 24, 5)
BASE = dict(layers=LAYERS, batch_size=48, samples=480, steps=4, bucket_mb=0.0002, lr=1e-2, seed=3)
STRATEGIES = {
    "dp": dict(strategy="dp"),
    "ddp": dict(strategy="ddp"),
    "ddp-no-overlap": dict(strategy="ddp", overlap=False),
    "zero1": dict(strategy="zero1"),
    "zero2": dict(strategy="zero2"),
    "zero3": dict(strategy="zero3"),
    "zero1-offload": dict(strategy="zero1", offload=True),
    "zero2-offload": dict(strategy="zero2", offload=True),
    "zero3-offload": dict(strategy="zero3", offload=True),
}
CLIP = 0.05  # well below the gradient norm of these runs (checked below): it really clips
CASES = {
    "adam": dict(optimizer="adam"),
    "sgd-clip": dict(optimizer="sgd", lr=0.2, clip_grad_norm=CLIP),
    "adam-clip-wd": dict(optimizer="adam", clip_grad_norm=CLIP, weight_decay=0.01),
}
FULL_PARAMS = ("dp", "ddp", "zero1", "zero2")  # strategies whose ranks hold all parameters
REL = 1e-5
PHI = sum(a * b + b for a, b in zip(LAYERS[:-1], LAYERS[1:], strict=False))


def run_training(comm, kw, save):
    """One train() on this rank: what the tests compare (rank 0 saves the fp32 parameters)."""
    doc, strategy = train(comm, TrainConfig(**dict(kw, save=save)), out=lambda *a: None)
    flat = getattr(strategy, "flat_params", None)
    return {"losses": doc["losses"], "sha": doc["param_sha256"], "skipped": doc["skipped_steps"],
            "flat": None if flat is None else flat.tobytes(), "units": len(strategy.layout.units)}


def load(path):
    with np.load(path) as f:
        return [f[name] for name, _ in param_specs(LAYERS)]


def rel_error(got, want):
    """max over parameters of max |got − want| / max |want|."""
    return max(float(np.abs(g.astype(np.float64) - w).max() / np.abs(w).max()) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def trained(pools, tmp_path_factory):
    """(world size, config) -> (per-rank results, rank 0's saved parameters), cached."""
    cache = {}
    folder = tmp_path_factory.mktemp("equivalence")

    def get(n, kw):
        key = (n, tuple(sorted(kw.items())))
        if key not in cache:
            path = str(folder / f"run{len(cache)}.npz")
            results = pools(n).run(run_training, kw, path)
            cache[key] = results, load(path)
        return cache[key]
    return get


def config(case, strategy=None, **extra):
    kw = dict(BASE, **CASES[case], **extra)
    kw.update(STRATEGIES[strategy] if strategy else dict(strategy="single"))
    return kw


MATRIX = [(case, n) for case in CASES for n in ([3] if case == "adam-clip-wd" else [2, 3, 4])]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("case,n", MATRIX, ids=[f"{c}-{n}" for c, n in MATRIX])
def test_same_parameters_as_single(trained, case, n, strategy):
    ref_results, ref_params = trained(1, config(case))
    results, params = trained(n, config(case, strategy))
    err = rel_error(params, ref_params)
    assert err <= REL, f"{strategy} on {n} ranks: max relative error {err:.3g} vs single"
    np.testing.assert_allclose(results[0]["losses"], ref_results[0]["losses"], rtol=REL)
    assert all(r["losses"] == results[0]["losses"] for r in results)  # one global loss
    assert all(r["sha"] == results[0]["sha"] for r in results)
    if STRATEGIES[strategy]["strategy"] in FULL_PARAMS:
        flats = [r["flat"] for r in results]
        assert all(f is not None for f in flats)
        assert all(f == flats[0] for f in flats), f"{strategy}: ranks hold different parameters"
    if strategy.startswith("ddp"):
        assert results[0]["units"] >= 3, "the model should span several buckets"


@pytest.mark.parametrize("case", list(CASES))
def test_runs_really_train(trained, case):
    """The reference moved away from the initial parameters (so equality above means
    something), and the loss went down."""
    results, params = trained(1, config(case))
    assert rel_error(params, init_params(LAYERS, BASE["seed"])) > 1e-3
    losses = results[0]["losses"]
    assert len(losses) == BASE["steps"] and losses[-1] < losses[0]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_clipping_changes_the_result(trained, optimizer):
    """CLIP is small enough to clip: the clipped reference differs from the unclipped one.
    (A strategy that clipped by a local, per-shard norm would therefore disagree with single
    in test_same_parameters_as_single.)"""
    clipped_case = {"adam": "adam-clip-wd", "sgd": "sgd-clip"}[optimizer]
    kw = config(clipped_case)
    unclipped = dict(kw, clip_grad_norm=None)
    _, with_clip = trained(1, kw)
    _, without = trained(1, unclipped)
    assert rel_error(with_clip, without) > 1e-3


def first_step_grad_norm(comm, kw):
    """Global gradient norm of the first step, computed from the single reference's state."""
    from ringcomm.train import data as datasets
    from ringcomm.train.models.mlp import linear_backward, linear_forward, softmax_cross_entropy
    cfg = TrainConfig(**kw)
    d = datasets.synthetic(cfg.layers[0], cfg.layers[-1], cfg.samples, cfg.seed)
    rows = datasets.BatchOrder(cfg.samples, cfg.batch_size, 1, cfg.seed).global_rows(0)
    params = init_params(cfg.layers, cfg.seed)
    acts = [d.x[rows]]
    n = len(params) // 2
    for i in range(n):
        acts.append(linear_forward(acts[-1], params[2 * i], params[2 * i + 1], relu=i < n - 1))
    _, g = softmax_cross_entropy(acts[-1], d.y[rows], cfg.batch_size)
    total = 0.0
    for i in reversed(range(n)):
        dW, db, g = linear_backward(acts[i], params[2 * i], acts[i + 1], g, relu=i < n - 1, need_dh=i > 0)
        total += float((dW.astype(np.float64) ** 2).sum() + (db.astype(np.float64) ** 2).sum())
    return total ** 0.5


def test_clip_threshold_is_below_the_gradient_norm(pools):
    norm = pools(1).run(first_step_grad_norm, config("adam"))[0]
    assert norm > 4 * CLIP


@pytest.mark.parametrize("n", [2, 3, 4])
def test_overlap_does_not_change_a_bit(trained, n):
    """DDP with and without overlap: identical bytes (buckets are reduced the same way)."""
    a, _ = trained(n, config("adam", "ddp"))
    b, _ = trained(n, config("adam", "ddp-no-overlap"))
    assert a[0]["flat"] == b[0]["flat"] and a[0]["sha"] == b[0]["sha"]
    for stage in ("zero1", "zero2"):
        c, _ = trained(n, config("adam", stage))
        d, _ = trained(n, config("adam", stage, overlap=False))
        assert c[0]["flat"] == d[0]["flat"], f"{stage} with and without overlap differ"


@pytest.mark.parametrize("strategy", ["dp", "ddp", "zero1", "zero2", "zero3"])
def test_one_rank_world_is_single(trained, strategy):
    """On a world of one, every strategy is the reference, bit for bit."""
    ref, _ = trained(1, config("adam"))
    res, _ = trained(1, config("adam", strategy))
    assert res[0]["sha"] == ref[0]["sha"]
    assert res[0]["losses"] == ref[0]["losses"]


# -- fp16 mixed precision -------------------------------------------------------------------------
FP16 = dict(precision="fp16", steps=6)
FP16_TOL = 5e-3  # absolute, per step; the runs below agree to ~1e-4


@pytest.mark.parametrize("case,n", [("adam", 2), ("adam", 4), ("sgd-clip", 3), ("adam-clip-wd", 3)])
def test_fp16_loss_curves_follow_fp32(trained, case, n):
    ref32, _ = trained(1, config(case, steps=6))
    curves = {"single": trained(1, config(case, **FP16))[0]}
    for strategy in ("dp", "ddp", "zero1", "zero2", "zero3", "zero2-offload"):
        curves[strategy] = trained(n, config(case, strategy, **FP16))[0]
    fp32 = np.array(ref32[0]["losses"])
    if case == "adam":
        assert fp32[-1] < fp32[0]
    for name, results in curves.items():
        losses = np.array(results[0]["losses"])
        assert results[0]["skipped"] == 0, f"{name}: no step should overflow here"
        assert np.abs(losses - fp32).max() <= FP16_TOL, f"{name} fp16 vs fp32 single: {losses} vs {fp32}"
        for other, other_results in curves.items():
            assert np.abs(losses - np.array(other_results[0]["losses"])).max() <= FP16_TOL, (name, other)
        if STRATEGIES.get(name, {}).get("strategy") in FULL_PARAMS:
            flats = [r["flat"] for r in results]
            assert all(f == flats[0] for f in flats), f"{name}: fp16 parameters differ across ranks"
            assert 2 * PHI <= len(flats[0]) < 2 * (PHI + 6 * n)  # stored as 2-byte floats


def run_and_gather(comm, kw):
    """The strategy returned by train() still answers full_params() (a collective)."""
    doc, strategy = train(comm, TrainConfig(**kw), out=lambda *a: None)
    return doc["param_sha256"], [p.copy() for p in strategy.full_params()]


def test_full_params_after_train_for_sharded_parameters(pools):
    import hashlib
    results = pools(2).run(run_and_gather, config("adam", "zero3"))
    for sha, params in results:
        h = hashlib.sha256()
        for p in params:
            h.update(np.ascontiguousarray(p, np.float32).tobytes())
        assert h.hexdigest() == sha


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_full_params_after_train_for_replicated_parameters(pools, strategy):
    """fp32 ddp/zero1/zero2 keep full parameters: full_params() after train() works and is
    the model the document hashes."""
    import hashlib
    for sha, params in pools(2).run(run_and_gather, config("adam", strategy)):
        h = hashlib.sha256()
        for p in params:
            h.update(np.ascontiguousarray(p, np.float32).tobytes())
        assert h.hexdigest() == sha


# -- the data order every strategy shares -----------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ranks_split_each_global_batch(n):
    """Rank r reads rows [r·B/N, (r+1)·B/N) of global batch k, which is the same for every N."""
    reference = BatchOrder(480, 48, 1, seed=3)
    order = BatchOrder(480, 48, n, seed=3)
    for step in range(25):  # two and a half epochs
        rows = [order.local_rows(step, r) for r in range(n)]
        assert all(len(r) == 48 // n for r in rows)
        assert np.array_equal(np.concatenate(rows), reference.global_rows(step))


def test_batch_order_is_a_fresh_permutation_each_epoch():
    order = BatchOrder(100, 20, 2, seed=1)
    epoch0 = np.concatenate([order.global_rows(s) for s in range(5)])
    epoch1 = np.concatenate([order.global_rows(s) for s in range(5, 10)])
    assert sorted(epoch0) == list(range(100)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1)
    assert np.array_equal(order.global_rows(2), BatchOrder(100, 20, 4, seed=1).global_rows(2))
    assert not np.array_equal(order.global_rows(0), BatchOrder(100, 20, 2, seed=2).global_rows(0))
    full = BatchOrder(100, 100, 4, seed=1)  # batch = dataset: full-batch training
    assert sorted(full.global_rows(0)) == sorted(full.global_rows(7)) == list(range(100))


def test_batch_order_errors():
    with pytest.raises(ValueError, match="does not divide by the world size 4"):
        BatchOrder(100, 50, 4, seed=0)
    with pytest.raises(ValueError, match="exceeds"):
        BatchOrder(100, 200, 1, seed=0)


def test_synthetic_data_is_deterministic_and_balanced_enough():
    a, b = synthetic(16, 5, 512, seed=3), synthetic(16, 5, 512, seed=3)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y) and np.array_equal(a.x_test, b.x_test)
    assert a.x.shape == (512, 16) and a.x.dtype == np.float32 and a.y.dtype == np.int64
    assert not np.array_equal(a.x, synthetic(16, 5, 512, seed=4).x)
    counts = np.bincount(a.y, minlength=5)
    assert counts.min() > 0 and a.num_classes == 5
