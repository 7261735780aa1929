"""Model-state memory and bytes on the wire per rank, measured on real training runs, against
the formulas of the ZeRO paper (DESIGN.md §1):

    DDP (p+g+K)Φ   ZeRO-1 (p+g)Φ + KΦ/N   ZeRO-2 pΦ + (g+K)Φ/N   ZeRO-3 (p+g+K)Φ/N
    traffic per rank per step: DDP, ZeRO-1, ZeRO-2 2(N−1)/N·Φ·e, ZeRO-3 3(N−1)/N·Φ·e,
    parameter server: rank 0 (N−1)Φ·e each way, the others Φ·e.

p = g = e (2 bytes in fp16, 4 in fp32); K = 12 for mixed-precision Adam (fp32 master, m, v),
8 for fp32 Adam (m, v). The formulas here are written out independently of ringcomm.memory.
Measured values may exceed them only by padding: every unit is padded to a multiple of N.
"""
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringcomm
from ringcomm.train.accounting.memory import CATEGORIES, MemoryRegistry, device_total, predicted
from ringcomm.train.config import TrainConfig
from ringcomm.train.trainer import train
from ringcomm.train.parallel.flat import Layout
from ringcomm.train.models.mlp import param_specs

pytestmark = pytest.mark.timeout(120)

LAYERS = (16, 32, 24, 5)
PHI = sum(a * b + b for a, b in zip(LAYERS[:-1], LAYERS[1:], strict=False))  # 1461 parameters
STEPS = 3
BASE = dict(layers=LAYERS, batch_size=48, samples=480, steps=STEPS, bucket_mb=0.0002, lr=1e-2)
RUNS = [("dp", False), ("ddp", False), ("zero1", False), ("zero2", False), ("zero3", False),
        ("zero1", True), ("zero2", True), ("zero3", True)]


def expected_bytes(strategy, phi, n, e, k, rank, offload):
    """The formula per category, as exact fractions."""
    phi = Fraction(phi)
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(strategy, 0)
    params = e * phi / n if stage >= 3 else e * phi
    grads = e * phi / n if stage >= 2 else e * phi
    optimizer = k * phi / n if stage >= 1 else k * phi
    if strategy == "dp" and rank != 0:
        optimizer = 0
    out = {"params": params, "grads": grads, "optimizer": Fraction(0), "optimizer_host": Fraction(0)}
    out["optimizer_host" if offload else "optimizer"] = optimizer
    return out


def run_measured(comm, kw):
    doc, strategy = train(comm, TrainConfig(**kw), out=lambda *a: None)
    lay = strategy.layout
    return {"doc": doc, "units": [u.padded for u in lay.units], "total": lay.total,
            "k": strategy.k_bytes(), "category_peaks": strategy.reg.peak()}


@pytest.fixture(scope="module")
def measured(pools):
    cache = {}

    def get(n, strategy, offload, precision, **extra):
        key = (n, strategy, offload, precision, tuple(sorted(extra.items())))
        if key not in cache:
            kw = dict(BASE, strategy=strategy, offload=offload, precision=precision, **extra)
            cache[key] = pools(n).run(run_measured, kw)
        return cache[key]
    return get


def every_run(test):
    """Parametrize ``test`` over every measured run: n, strategy (+offload), precision."""
    test = pytest.mark.parametrize("n", [2, 4])(test)
    test = pytest.mark.parametrize("strategy,offload", RUNS, ids=[s + ("+offload" if o else "") for s, o in RUNS])(test)
    return pytest.mark.parametrize("precision", ["fp32", "fp16"])(test)


@every_run
def test_model_state_bytes_match_formula(measured, n, strategy, offload, precision):
    results = measured(n, strategy, offload, precision)
    e = 2 if precision == "fp16" else 4
    k = 12 if precision == "fp16" else 8
    assert results[0]["k"] == k
    units = len(results[0]["units"])
    per_element = {"params": e, "grads": e, "optimizer": k, "optimizer_host": k}
    doc = results[0]["doc"]
    assert doc["num_params"] == PHI
    for rank, res in enumerate(results):
        row = res["doc"]["per_rank"][rank]
        assert row["rank"] == rank
        want = expected_bytes(strategy, PHI, n, e, k, rank, offload)
        got = row["model_state_bytes"]
        assert set(got) == set(CATEGORIES)
        for c in CATEGORIES:
            slack = units * n * per_element[c]  # < N padding elements per unit
            assert 0 <= got[c] - want[c] < slack, \
                f"rank {rank} {c}: measured {got[c]} vs formula {float(want[c])} (slack {slack})"
            assert row["predicted_model_state_bytes"][c] == pytest.approx(float(want[c]), abs=1e-6)
        # the totals of the brief, spelled out
        total = device_total(got)
        formula_total = {"dp": (2 * e + (k if rank == 0 else 0)) * PHI, "ddp": (2 * e + k) * PHI,
                         "zero1": 2 * e * PHI + Fraction(k * PHI, n),
                         "zero2": e * PHI + Fraction((e + k) * PHI, n),
                         "zero3": Fraction((2 * e + k) * PHI, n)}[strategy]
        if offload:
            formula_total -= Fraction(k * PHI, n)
        assert 0 <= total - formula_total < units * n * (2 * e + k)
        # the peak covers the final state; sharding keeps zero2/zero3 under DDP's need
        peak = row["peak_model_state_bytes"]
        assert peak >= total
        if strategy in ("zero2", "zero3"):
            assert peak < (2 * e + k) * PHI
        if offload:
            assert got["optimizer"] == 0 and got["optimizer_host"] > 0
    assert doc["predicted_bytes"] == results[0]["doc"]["per_rank"][0]["predicted_model_state_bytes"]


def test_mixed_precision_totals_are_the_papers(measured):
    """fp16 + Adam: K = 12, so DDP 16Φ, ZeRO-1 4Φ+12Φ/N, ZeRO-2 2Φ+14Φ/N, ZeRO-3 16Φ/N."""
    n = 4
    want = {"ddp": 16 * PHI, "zero1": 4 * PHI + Fraction(12 * PHI, n),
            "zero2": 2 * PHI + Fraction(14 * PHI, n), "zero3": Fraction(16 * PHI, n)}
    for strategy, formula in want.items():
        row = measured(n, strategy, False, "fp16")[0]["doc"]["per_rank"][0]
        assert 0 <= device_total(row["model_state_bytes"]) - formula < 3 * n * 16, strategy
    # each stage saves memory over the previous one
    totals = [device_total(measured(n, s, False, "fp16")[0]["doc"]["per_rank"][0]["model_state_bytes"])
              for s in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


@pytest.mark.parametrize("precision,k", [("fp16", 4), ("fp32", 0)])
def test_sgd_optimizer_bytes(measured, precision, k):
    """SGD keeps no state: K is the fp32 master copy in fp16 (4) and nothing in fp32."""
    n = 2
    for strategy in ("ddp", "zero2"):
        results = measured(n, strategy, False, precision, optimizer="sgd")
        assert results[0]["k"] == k
        for rank, res in enumerate(results):
            got = res["doc"]["per_rank"][rank]["model_state_bytes"]["optimizer"]
            want = Fraction(k * PHI, 1 if strategy == "ddp" else n)
            assert 0 <= got - want < 3 * n * max(k, 1), (strategy, rank, got, float(want))


@every_run
def test_bytes_sent_per_step_match_formula(measured, n, strategy, offload, precision):
    results = measured(n, strategy, offload, precision)
    e = 2 if precision == "fp16" else 4
    doc = results[0]["doc"]
    assert doc["skipped_steps"] == 0  # a skipped step would not publish parameters
    units = results[0]["units"]
    for rank, row in enumerate(doc["per_rank"]):
        if strategy == "dp":
            factor = Fraction(n - 1) if rank == 0 else Fraction(1)
            exact = factor * sum(units) * e
        else:
            factor = Fraction((3 if strategy == "zero3" else 2) * (n - 1), n)
            exact = factor * sum(units) * e  # every unit is padded to a multiple of N
        formula = factor * PHI * e
        for what in ("bytes_sent", "bytes_received"):
            per_step = Fraction(row[what], STEPS)
            assert 0 <= per_step - formula < factor * len(units) * n * e, \
                f"rank {rank} {what}/step {float(per_step)} vs formula {float(formula)}"
            assert per_step == exact, f"rank {rank} {what}/step {float(per_step)} vs {float(exact)}"
        assert row["predicted_bytes_sent_per_step"] == pytest.approx(float(formula))
        assert row["bytes_sent_per_step"] == pytest.approx(row["bytes_sent"] / STEPS)


def test_parameter_server_hot_spot_grows_with_n(measured):
    """Ring strategies send ~2Φ whatever N; the parameter server's rank 0 sends (N−1)Φ."""
    sent = {n: measured(n, "dp", False, "fp32")[0]["doc"]["per_rank"] for n in (2, 4)}
    ring = {n: measured(n, "ddp", False, "fp32")[0]["doc"]["per_rank"] for n in (2, 4)}
    assert sent[4][0]["bytes_sent"] > 2.5 * sent[2][0]["bytes_sent"]
    assert max(r["bytes_sent"] for r in ring[4]) < 2 * PHI * 4 * STEPS
    assert sent[4][0]["bytes_sent"] > max(r["bytes_sent"] for r in ring[4])


def test_zero2_keeps_at_most_two_unit_gradient_buffers(measured):
    """ZeRO-2 frees a unit's gradients once reduce-scattered and never holds more than two
    unit buffers besides its shard: the gradient peak stays far below a full gradient."""
    n = 2
    results = measured(n, "zero2", False, "fp32", bucket_mb=1e-5)  # one bucket per parameter
    units = sorted(results[0]["units"], reverse=True)
    assert len(units) == 2 * (len(LAYERS) - 1)
    e = 4
    for res in results:
        shard = sum(units) // n * e
        assert res["category_peaks"]["grads"] <= shard + (units[0] + units[1]) * e
        assert res["category_peaks"]["grads"] > shard  # unit buffers did exist


def test_zero3_gathers_at_most_two_layers(measured):
    """ZeRO-3 holds its parameter shard plus the layer in use and the prefetched one."""
    n = 2
    results = measured(n, "zero3", False, "fp32")
    units = sorted(results[0]["units"], reverse=True)
    for res in results:
        shard = sum(units) // n * 4
        peak = res["category_peaks"]["params"]
        assert shard < peak <= shard + (units[0] + units[1]) * 4


# -- the formulas and the registry on their own ---------------------------------------------------
def paper_table(*extra):
    root = os.path.dirname(os.path.dirname(os.path.abspath(ringcomm.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "ringcomm.memory", "--params", "7.5e9", "--world-size", "64",
                          *extra], capture_output=True, text=True, timeout=60, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    totals = {}
    for line in out.stdout.splitlines():
        words = line.split()
        if words and words[0] in ("ddp", "zero1", "zero2", "zero3"):
            totals[words[0]] = words[-1]
    return totals


@pytest.mark.parametrize("extra", [(), ("--k", "12")])
def test_memory_cli_reproduces_the_zero_paper(extra):
    assert paper_table(*extra) == {"ddp": "120.0", "zero1": "31.4", "zero2": "16.6", "zero3": "1.9"}


def test_predicted_formulas():
    phi, n = 1000, 8
    assert predicted("ddp", phi, n) == {"params": 2000, "grads": 2000, "optimizer": 12000, "optimizer_host": 0}
    assert predicted("single", phi, n) == predicted("ddp", phi, n)
    assert predicted("zero1", phi, n) == {"params": 2000, "grads": 2000, "optimizer": 1500, "optimizer_host": 0}
    assert predicted("zero2", phi, n) == {"params": 2000, "grads": 250, "optimizer": 1500, "optimizer_host": 0}
    assert predicted("zero3", phi, n) == {"params": 250, "grads": 250, "optimizer": 1500, "optimizer_host": 0}
    assert predicted("dp", phi, n, rank=0) == predicted("ddp", phi, n)
    assert predicted("dp", phi, n, rank=3)["optimizer"] == 0
    assert predicted("zero2", phi, n, offload=True) == {"params": 2000, "grads": 250, "optimizer": 0,
                                                        "optimizer_host": 1500}
    assert predicted("zero3", phi, n, p=4, g=4, k=8) == {"params": 500, "grads": 500, "optimizer": 1000,
                                                         "optimizer_host": 0}
    for s in ("ddp", "zero1", "zero2", "zero3"):
        assert device_total(predicted(s, phi, n, offload=True)) == device_total(predicted(s, phi, n)) - \
            predicted(s, phi, n)["optimizer"]
    gb = {s: device_total(predicted(s, 7.5e9, 64)) / 1e9 for s in ("ddp", "zero1", "zero2", "zero3")}
    assert [round(gb[s], 1) for s in ("ddp", "zero1", "zero2", "zero3")] == [120.0, 31.4, 16.6, 1.9]


def test_registry_alloc_free_current_peak():
    reg = MemoryRegistry()
    a = reg.alloc("params", "a", (4, 4), np.float16)
    assert a.shape == (4, 4) and a.dtype == np.float16 and not a.any()
    reg.alloc("grads", "b", 10, np.float32)
    h = reg.alloc("optimizer_host", "h", 100, np.float32)
    assert reg.current() == {"params": 32, "grads": 40, "optimizer": 0, "optimizer_host": 400}
    assert reg.peak_total() == 72  # host memory is not device model state
    reg.free("b")
    assert reg.current()["grads"] == 0
    assert reg.peak()["grads"] == 40 and reg.peak_total() == 72
    assert "b" not in reg._live and "a" in reg._live
    reg.alloc("grads", "b", 5, np.float32)  # a freed name can be used again
    assert reg.current()["grads"] == 20 and reg.peak()["grads"] == 40
    reg.alloc("optimizer", "m", 20, np.float32)
    assert reg.peak_total() == 32 + 20 + 80
    assert reg.peak() == {"params": 32, "grads": 40, "optimizer": 80, "optimizer_host": 400}
    del h


def test_registry_peak_is_the_simultaneous_maximum():
    reg = MemoryRegistry()
    reg.alloc("params", "x", 100, np.uint8)
    reg.free("x")
    reg.alloc("grads", "y", 60, np.uint8)
    reg.alloc("grads", "z", 30, np.uint8)
    assert reg.peak_total() == 100  # 90 at most at once after the 100 were freed
    reg.alloc("params", "w", 20, np.uint8)
    assert reg.peak_total() == 110


def test_registry_rejects_duplicates_and_unknown_categories():
    reg = MemoryRegistry()
    reg.alloc("params", "W0", 4, np.float32)
    with pytest.raises(ValueError, match="W0"):
        reg.alloc("grads", "W0", 4, np.float32)
    with pytest.raises(ValueError, match="activations"):
        reg.alloc("activations", "act", 4, np.float32)
    assert reg.current() == {"params": 16, "grads": 0, "optimizer": 0, "optimizer_host": 0}
    with pytest.raises(KeyError):
        reg.free("never allocated")


# -- the layout that the padding slack above comes from ------------------------------------------
@settings(max_examples=80, deadline=None)
@given(widths=st.lists(st.integers(1, 30), min_size=2, max_size=5), n=st.integers(1, 5),
       unit_bytes=st.integers(1, 6000), itemsize=st.sampled_from([2, 4]), per_layer=st.booleans(),
       first_bytes=st.integers(1, 3000))
def test_layout_invariants(widths, n, unit_bytes, itemsize, per_layer, first_bytes):
    specs = param_specs(widths)
    sizes = [int(np.prod(shape)) for _, shape in specs]
    members = [[2 * i, 2 * i + 1] for i in range(len(widths) - 1)] if per_layer else None
    lay = Layout(specs, n, unit_bytes, itemsize, layer_members=members, first_bytes=first_bytes)
    # every parameter in exactly one unit, in reverse model order (backward's order)
    assert [p for u in lay.units for p in u.params] == list(range(len(specs)))[::-1]
    assert lay.num_params == sum(sizes)
    offset = shard_offset = 0
    for u in lay.units:
        assert u.start == offset and u.shard_start == shard_offset
        assert u.length == sum(sizes[p] for p in u.params)
        assert u.padded % n == 0 and 0 <= u.padded - u.length < n and u.shard_size * n == u.padded
        assert [u.own_range(r) for r in range(n)] == \
            [(u.start + r * u.shard_size, u.start + (r + 1) * u.shard_size) for r in range(n)]
        cursor = u.start
        for p in u.params:  # contiguous inside the unit, padding at its end
            assert lay.offsets[p] == cursor
            cursor += sizes[p]
        offset += u.padded
        shard_offset += u.shard_size
    assert lay.total == offset and lay.shard_total == shard_offset
    assert lay.total - lay.num_params < n * len(lay.units)
    if per_layer:  # ZeRO-3: one unit per layer, b_i then W_i
        assert [u.params for u in lay.units] == [[2 * i + 1, 2 * i] for i in reversed(range(len(widths) - 1))]
    else:  # buckets: each closed as soon as it reaches its cap; the first cap is the small one
        for i, u in enumerate(lay.units):
            cap = min(first_bytes, unit_bytes) if i == 0 else unit_bytes
            filled = u.length * itemsize
            if i < len(lay.units) - 1:
                assert filled >= cap and filled - sizes[u.params[-1]] * itemsize < cap
            else:
                assert filled - sizes[u.params[-1]] * itemsize < cap
    # pack / views / shards round trip
    rng = np.random.default_rng(len(specs) * 31 + n)
    params = [rng.standard_normal(shape).astype(np.float32) for _, shape in specs]
    flat = lay.pack(params, np.float32)
    assert all(np.array_equal(a, b) for a, b in zip(lay.views(flat), params, strict=True))
    rebuilt = np.full(lay.total, np.nan, np.float32)
    for r in range(n):
        shard = lay.own_shard(flat, r)
        assert shard.shape == (lay.shard_total,)
        lay.scatter_shard(shard, rebuilt, r)
    assert np.array_equal(rebuilt, flat)
    for u in lay.units:
        views = lay.unit_views(u, flat[u.start:u.stop])
        assert all(np.array_equal(views[p], params[p]) for p in u.params)
        assert not flat[u.start + u.length:u.stop].any()  # padding is zero


def test_first_bucket_is_small():
    """PyTorch DDP's default: the first bucket closes at 1 MiB, the next ones at --bucket-mb."""
    layers = (256,) * 9 + (10,)  # eight 256 KiB weight matrices in fp32, then a small output layer
    lay = Layout(param_specs(layers), 2, 25 * 2 ** 20, 4)
    sizes = [int(np.prod(shape)) for _, shape in param_specs(layers)]
    first = lay.units[0]
    assert first.length * 4 >= 2 ** 20 > (first.length - sizes[first.params[-1]]) * 4
    assert len(lay.units) == 2  # everything else fits one 25 MB bucket
    assert lay.units[1].length * 4 < 25 * 2 ** 20


@pytest.mark.parametrize("layer_members", [None, [[0, 1], [2, 3], [4, 5, 0]]])
def test_parameters_alone_get_a_unit_of_their_own(layer_members):
    """A copy held elsewhere under another layout (a tied embedding) is a unit by itself,
    so both copies are reduced in the same chunks."""
    specs = [("wte", (6, 4)), ("wpe", (3, 4)), ("w", (4, 4)), ("b", (4,)), ("lnf.w", (4,)), ("lnf.b", (4,))]
    lay = Layout(specs, 3, 1 << 20, 4, layer_members=layer_members, alone=[0])
    assert [u.params for u in lay.units if 0 in u.params] == [[0]]
    unit = lay.unit_of_param[0]
    assert (unit.length, unit.padded, unit.shard_size) == (24, 24, 8)
    assert sorted(p for u in lay.units for p in u.params) == list(range(6))
