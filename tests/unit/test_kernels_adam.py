"""reference.adam_step (adam.cu's reference) against the CPU path: several steps of what
Strategy.update runs, bit for bit against Strategy.update with Adam in torch.optim.Adam's order,
overflowed steps, clipping and the fp16 copy included; no check of its own, the gradient left
alone, the scalars the CPU path's doubles, and clipping with kernels.scale the Python float
product."""
import math
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ringcomm import kernels
from ringcomm.train import optim
from ringcomm.train.parallel.strategy import Replicated

from kernel_helpers import assert_same_bits, ref

pytestmark = pytest.mark.timeout(120)


# -- adam.cu reference vs the CPU path --------------------------------------------------------

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8


class TorchOrderAdam(optim.Adam):
    """Adam written out with numpy in torch.optim.Adam's order of operations: an oracle
    independent of ringcomm.kernels (which optim.Adam calls)."""

    def update(self, param, grad, offset=0):
        b1, b2 = self.betas
        m, v = self.m[offset:offset + param.size], self.v[offset:offset + param.size]
        grad = grad.copy()
        if self.weight_decay:
            grad += self.weight_decay * param
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * grad * grad
        denom = np.sqrt(v)
        denom /= math.sqrt(1 - b2 ** self.t)
        denom += self.eps
        param -= self.lr / (1 - b1 ** self.t) * (m / denom)


def cpu_strategy(size, mixed, weight_decay, clip, master0):
    """A one-rank Replicated strategy with just what Strategy.update touches: the real
    update, owned_grad, master_pieces, write_back and LossScaler, and Adam in torch's order
    written out independently of the kernels."""
    s = object.__new__(Replicated)
    s.mixed, s.rank = mixed, 0
    s.meta = types.SimpleNamespace(all_reduce=lambda x: x)  # one rank: the sum is itself
    s._weight = np.ones(size)  # every element counts in the norm
    s.cfg = types.SimpleNamespace(clip_grad_norm=clip, offload=False)
    s.scaler = optim.LossScaler(enabled=mixed)
    s.layout = types.SimpleNamespace(total=size)
    s.flat_grads = np.zeros(size, np.float16 if mixed else np.float32)
    s.optimizer = TorchOrderAdam(size, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    if mixed:
        s.master = master0.copy()
        s.flat_params = master0.astype(np.float16)
    else:
        s.master = s.flat_params = master0.copy()
    return s


def gradients(rng, size, steps, scale, mixed, bad_steps):
    for step in range(steps):
        g = rng.standard_normal(size).astype(np.float32) * np.float32(rng.uniform(1e-4, 1e-2))
        g[rng.random(size) < 0.02] = 0.0
        if mixed:
            g = (g * np.float32(scale)).astype(np.float16)  # may overflow to inf by itself
        if step in bad_steps:
            g[rng.integers(size)] = np.inf if step % 2 else np.nan
        yield g


@pytest.mark.parametrize("clip", [None, 0.1])  # gradient norms run from 3e-3 to 0.3
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("mixed", [True, False])
def test_adam_step_is_strategy_update(mixed, weight_decay, clip):
    """Several steps of what Strategy.update runs -- unscale and check, clip, reference.adam_step,
    the fp16 copy -- against Strategy.update with Adam in torch's order and write_back, bit for
    bit, including overflowed steps (skipped, nothing changes, t stays). Unscaling and the
    clipping product are the CPU path's numpy written out here; Strategy.update clips with
    kernels.scale."""
    rng = np.random.default_rng([mixed, int(weight_decay * 100), clip is not None])
    size = 1031
    master0 = rng.standard_normal(size).astype(np.float32) * np.float32(0.1)
    cpu = cpu_strategy(size, mixed, weight_decay, clip, master0)
    master, m, v = master0.copy(), np.zeros(size, np.float32), np.zeros(size, np.float32)
    params = master0.astype(np.float16) if mixed else None
    scaler, t, clipped = optim.LossScaler(enabled=mixed), 0, 0
    bad = {2, 5} if mixed else set()
    for step, grad in enumerate(gradients(rng, size, 8, scaler.scale, mixed, bad)):
        cpu.flat_grads[...] = grad
        g = grad.astype(np.float32)
        g /= scaler.scale
        overflow = not np.isfinite(g).all()
        snapshot = (master.copy(), m.copy(), v.copy())
        assert scaler.update(overflow) == cpu.update(0.0)[1] == overflow
        if overflow:
            assert step in bad or not np.isfinite(grad).all()
            for now, before in zip((master, m, v), snapshot, strict=True):
                assert_same_bits(now, before)
        else:
            if clip:
                coef = optim.clip_coefficient(ref.sq_norm(g), clip)
                clipped += coef < 1
                g *= coef
            t += 1
            assert ref.adam_step(master, g, m, v, LR, *BETAS, EPS, weight_decay, t) is None
            if mixed:
                ref.cast_to_half(master, params)
        assert cpu.optimizer.t == t and scaler.scale == cpu.scaler.scale
        assert_same_bits(master, cpu.master)
        assert_same_bits(m, cpu.optimizer.m)
        assert_same_bits(v, cpu.optimizer.v)
        if mixed:
            assert_same_bits(params, cpu.flat_params)
    assert t >= 5
    assert not clip or 0 < clipped < t  # steps with and without clipping


def test_adam_step_has_no_check_and_takes_the_step_like_the_unscaled_cpu_path():
    """fp32 training has no loss scaler: the CPU path updates even with a NaN gradient."""
    rng = np.random.default_rng(7)
    size = 257
    master0 = rng.standard_normal(size).astype(np.float32)
    cpu = cpu_strategy(size, False, 0.01, None, master0)
    master, m, v = master0.copy(), np.zeros(size, np.float32), np.zeros(size, np.float32)
    for step, grad in enumerate(gradients(rng, size, 4, 1.0, False, bad_steps={1})):
        cpu.flat_grads[...] = grad
        with np.errstate(invalid="ignore"):
            assert cpu.update(0.0)[1] is False
            ref.adam_step(master, grad, m, v, LR, *BETAS, EPS, 0.01, step + 1)
        for ours, theirs in ((master, cpu.master), (m, cpu.optimizer.m), (v, cpu.optimizer.v)):
            assert_same_bits(ours, theirs)
    assert np.isnan(master).any()


def test_adam_step_does_not_modify_grad_and_accepts_numpy_scalars():
    rng = np.random.default_rng(3)
    grad = rng.standard_normal(64).astype(np.float32)
    keep = grad.copy()
    a = [np.ones(64, np.float32), np.zeros(64, np.float32), np.zeros(64, np.float32)]
    b = [x.copy() for x in a]
    ref.adam_step(*a[:1], grad, *a[1:], 1e-3, 0.9, 0.999, 1e-8, 0.1, 1)
    ref.adam_step(*b[:1], grad, *b[1:], np.float64(1e-3), np.float64(0.9), np.float64(0.999),
                  np.float64(1e-8), np.float64(0.1), np.int64(1))
    assert_same_bits(grad, keep)
    for x, y in zip(a, b, strict=True):
        assert_same_bits(x, y)
    assert not np.array_equal(a[0], np.ones(64, np.float32))  # a step was taken


def test_adam_scalars_are_the_cpu_path_doubles():
    s = ref.adam_scalars(2e-3, 0.9, 0.999, 1e-8, 0.1, 7)
    assert s["step_size"] == 2e-3 / (1 - 0.9 ** 7)
    assert s["bias_correction2_sqrt"] == math.sqrt(1 - 0.999 ** 7)
    assert s["one_minus_beta1"] == 1 - 0.9 and s["one_minus_beta2"] == 1 - 0.999
    assert s["use_weight_decay"] and not ref.adam_scalars(1, .9, .9, 1, 0.0, 1)["use_weight_decay"]


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 64), elements=st.floats(width=32)),
       st.floats(0.0, 1.0), st.floats(0.0, 1e6))
def test_clipping_with_scale_is_the_python_float_product(x, max_norm, sq_norm):
    """Strategy.update clips with kernels.scale(grad, clip_coefficient(...)): the same bits as
    the CPU path's ``grad *= coefficient`` with the Python float (NEP 50: rounded to fp32,
    one fp32 product), subnormals and specials included."""
    coef = optim.clip_coefficient(sq_norm, max_norm)
    assert type(coef) is float
    with np.errstate(all="ignore"):
        expected = x.copy()
        expected *= coef
        assert_same_bits(ref.scale(x.copy(), coef), expected)
        assert_same_bits(kernels.scale(x.copy(), coef), expected)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("size", [1, ref.ADAM_BLOCK - 1, ref.ADAM_BLOCK, 2 * ref.ADAM_BLOCK + 3])
def test_the_block_by_block_step_is_the_whole_array_step(size, weight_decay):
    """The CPU step takes ADAM_BLOCK elements at a time: bit for bit the same as Adam in
    torch's order over the whole array, at and across the blocks' edges, and the gradient
    left as it was."""
    rng = np.random.default_rng(size)
    master = rng.standard_normal(size).astype(np.float32)
    ours = master.copy()
    oracle = TorchOrderAdam(size, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    m, v = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for t in range(1, 4):
        g = rng.standard_normal(size).astype(np.float32)
        before = g.copy()
        oracle.t = t
        oracle.update(master, g)
        ref.adam_step(ours, g, m, v, LR, *BETAS, EPS, weight_decay, t)
        assert_same_bits(ours, master)
        assert_same_bits(m, oracle.m)
        assert_same_bits(v, oracle.v)
        assert_same_bits(g, before)
