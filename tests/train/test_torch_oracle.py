"""PyTorch as an independent oracle for the numpy MLP: forward, backward and Adam.

The numpy model stores W_i as (in, out) and computes ``h @ W + b``; torch's ``nn.Linear``
keeps ``weight`` as (out, in) and computes ``h @ weight.T + bias``, so the same model in
torch has ``weight = W.T``. Torch runs in float64 (the exact reference); the numpy model
computes in float32, so the tolerances are float32's.
"""
import numpy as np
import pytest

from ringcomm.train.config import TrainConfig
from ringcomm.train.trainer import train
from ringcomm.train.data import BatchOrder, synthetic
from ringcomm.train.models.mlp import (init_params, linear_backward, linear_forward, param_specs,
                                  softmax_cross_entropy)
from ringcomm.train.optim import SGD, Adam

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

LAYERS = (16, 32, 24, 5)


# -- the numpy side: exactly what a strategy's step does, on one process -------------------
class NumpyMLP:
    def __init__(self, params, optimizer):
        self.specs = param_specs(LAYERS)
        sizes = [p.size for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.flat = np.concatenate([p.reshape(-1) for p in params]).astype(np.float32)
        self.optimizer = optimizer

    def params(self):
        return [self.flat[lo:hi].reshape(shape) for lo, hi, (_, shape)
                in zip(self.offsets[:-1], self.offsets[1:], self.specs, strict=True)]

    def loss_and_grads(self, x, y):
        params = self.params()
        n = len(params) // 2
        acts = [x.astype(np.float32)]
        for i in range(n):
            acts.append(linear_forward(acts[-1], params[2 * i], params[2 * i + 1], relu=i < n - 1))
        loss, d = softmax_cross_entropy(acts[-1], y, len(y))
        grads = [None] * len(params)
        for i in reversed(range(n)):
            dW, db, d = linear_backward(acts[i], params[2 * i], acts[i + 1], d, relu=i < n - 1,
                                        need_dh=i > 0)
            grads[2 * i], grads[2 * i + 1] = dW, db
        return loss, grads

    def step(self, x, y):
        loss, grads = self.loss_and_grads(x, y)
        flat_grad = np.concatenate([g.reshape(-1) for g in grads]).astype(np.float32)
        self.optimizer.begin_step()
        self.optimizer.update(self.flat, flat_grad.copy(), 0)
        return loss, grads


# -- the torch side ------------------------------------------------------------------------
def torch_model(params):
    layers = []
    n = len(params) // 2
    for i in range(n):
        W, b = params[2 * i], params[2 * i + 1]
        lin = torch.nn.Linear(W.shape[0], W.shape[1]).double()
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(W.T.astype(np.float64)))
            lin.bias.copy_(torch.from_numpy(b.astype(np.float64)))
        layers.append(lin)
        if i < n - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def torch_params(model):
    """Model-order numpy arrays in this project's layout (W as (in, out))."""
    out = []
    for module in model:
        if isinstance(module, torch.nn.Linear):
            out.append(module.weight.detach().numpy().T.copy())
            out.append(module.bias.detach().numpy().copy())
    return out


def torch_grads(model):
    out = []
    for module in model:
        if isinstance(module, torch.nn.Linear):
            out.append(module.weight.grad.detach().numpy().T.copy())
            out.append(module.bias.grad.detach().numpy().copy())
    return out


def torch_step(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.CrossEntropyLoss()(model(torch.from_numpy(x.astype(np.float64))), torch.from_numpy(y))
    loss.backward()
    grads = torch_grads(model)
    opt.step()
    return loss.item(), grads


def assert_close(got, want, rel, what):
    """max |got − want| ≤ rel · max |want| (arrays of one parameter)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got - want).max())
    assert err <= rel * scale, f"{what}: max abs error {err:.3g} > {rel:g} x {scale:.3g}"


def batches(steps, batch, seed=5):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, LAYERS[0])).astype(np.float32),
             rng.integers(0, LAYERS[-1], batch).astype(np.int64)) for _ in range(steps)]


# -- tests ---------------------------------------------------------------------------------
def test_init_matches_torch_linear_bounds():
    """U(−1/√in, 1/√in) for W and b, as torch.nn.Linear; deterministic from the seed."""
    params = init_params(LAYERS, seed=7)
    assert [p.shape for p in params] == [s for _, s in param_specs(LAYERS)]
    for (name, _), p in zip(param_specs(LAYERS), params, strict=True):
        fan_in = LAYERS[int(name[1:])]
        assert p.dtype == np.float32
        assert np.abs(p).max() <= 1 / np.sqrt(fan_in)
        assert np.abs(p).max() > 0.5 / np.sqrt(fan_in)  # really spread over the interval
    again = init_params(LAYERS, seed=7)
    other = init_params(LAYERS, seed=8)
    assert all(np.array_equal(a, b) for a, b in zip(params, again, strict=True))
    assert not np.array_equal(params[0], other[0])


def test_forward_and_backward_match_torch():
    params = init_params(LAYERS, seed=1)
    x, y = batches(1, 40)[0]
    loss, grads = NumpyMLP(params, Adam(1)).loss_and_grads(x, y)
    model = torch_model(params)
    t_loss = torch.nn.CrossEntropyLoss()(model(torch.from_numpy(x.astype(np.float64))), torch.from_numpy(y))
    t_loss.backward()
    t_loss = t_loss.item()
    assert abs(loss - t_loss) <= 1e-6 * abs(t_loss)
    for (name, _), g, tg in zip(param_specs(LAYERS), grads, torch_grads(model), strict=True):
        assert_close(g, tg, 1e-5, f"gradient of {name}")


def test_loss_share_sums_to_the_global_mean():
    """Two halves of a batch, each divided by the global batch, sum to the full-batch loss
    and gradient: what makes gradient summation over ranks exact."""
    params = init_params(LAYERS, seed=2)
    x, y = batches(1, 24)[0]
    h = x
    for i in range(len(params) // 2):
        h = linear_forward(h, params[2 * i], params[2 * i + 1], relu=i < len(params) // 2 - 1)
    full, dfull = softmax_cross_entropy(h, y, 24)
    a, da = softmax_cross_entropy(h[:10], y[:10], 24)
    b, db = softmax_cross_entropy(h[10:], y[10:], 24)
    assert abs(a + b - full) <= 1e-6 * full
    np.testing.assert_allclose(np.concatenate([da, db]), dfull, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("lr", [1e-3, 3e-2])
def test_adam_steps_match_torch(lr, weight_decay):
    """Several steps of forward, backward and Adam: loss, every gradient and every updated
    parameter agree with torch.optim.Adam (PyTorch defaults betas/eps, L2 weight decay)."""
    params = init_params(LAYERS, seed=3)
    total = sum(p.size for p in params)
    ours = NumpyMLP(params, Adam(total, lr=lr, weight_decay=weight_decay))
    model = torch_model(params)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=weight_decay)
    for step, (x, y) in enumerate(batches(6, 32)):
        loss, grads = ours.step(x, y)
        t_loss, t_grads = torch_step(model, opt, x, y)
        assert abs(loss - t_loss) <= 1e-5 * abs(t_loss), f"step {step}: loss {loss} vs torch {t_loss}"
        for (name, _), g, tg in zip(param_specs(LAYERS), grads, t_grads, strict=True):
            assert_close(g, tg, 2e-5, f"step {step}: gradient of {name}")
        for (name, _), p, tp in zip(param_specs(LAYERS), ours.params(), torch_params(model), strict=True):
            assert_close(p, tp, 2e-6, f"step {step}: {name} after Adam")
    assert ours.optimizer.t == 6


def test_adam_update_alone_matches_torch_on_extreme_gradients():
    """The Adam formula itself (bias corrections, eps placement) on gradients spanning
    many orders of magnitude, including exact zeros and values far below eps."""
    rng = np.random.default_rng(4)
    size = 4000
    p0 = rng.standard_normal(size).astype(np.float32)
    ours = Adam(size, lr=1e-2)
    mine = p0.copy()
    tp = torch.tensor(p0.astype(np.float64), requires_grad=True)
    opt = torch.optim.Adam([tp], lr=1e-2)
    for step in range(5):
        g = (rng.standard_normal(size) * 10.0 ** rng.uniform(-12, 2, size)).astype(np.float32)
        g[:50] = 0.0
        ours.begin_step()
        ours.update(mine, g.copy())
        tp.grad = torch.from_numpy(g.astype(np.float64))
        opt.step()
        assert_close(mine, tp.detach().numpy(), 1e-6, f"step {step}")
        np.testing.assert_allclose(mine, tp.detach().numpy(), rtol=0, atol=2e-6)


def test_sgd_matches_torch():
    params = init_params(LAYERS, seed=6)
    total = sum(p.size for p in params)
    ours = NumpyMLP(params, SGD(total, lr=0.1, weight_decay=0.01))
    model = torch_model(params)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)
    for step, (x, y) in enumerate(batches(4, 32, seed=9)):
        ours.step(x, y)
        torch_step(model, opt, x, y)
        for (name, _), p, tp in zip(param_specs(LAYERS), ours.params(), torch_params(model), strict=True):
            assert_close(p, tp, 2e-6, f"step {step}: {name} after SGD")


# -- a whole training run through train() against the same steps in torch ----------------
TRAIN_CFG = dict(strategy="single", layers=LAYERS, batch_size=64, samples=512, steps=8, lr=1e-2,
                 seed=11, optimizer="adam", bucket_mb=0.0002)


def run_single(comm, kw):
    doc, strategy = train(comm, TrainConfig(**kw), out=lambda *a: None)
    return doc["losses"], [p.copy() for p in strategy.full_params()]


def test_single_training_run_matches_torch(pools):
    losses, params = pools(1).run(run_single, TRAIN_CFG)[0]
    cfg = TrainConfig(**TRAIN_CFG)
    data = synthetic(cfg.layers[0], cfg.layers[-1], cfg.samples, cfg.seed)
    order = BatchOrder(cfg.samples, cfg.batch_size, 1, cfg.seed)
    model = torch_model(init_params(cfg.layers, cfg.seed))
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    t_losses = []
    for step in range(cfg.steps):
        rows = order.global_rows(step)
        t_losses.append(torch_step(model, opt, data.x[rows], data.y[rows])[0])
    np.testing.assert_allclose(losses, t_losses, rtol=1e-5)
    for (name, _), p, tp in zip(param_specs(cfg.layers), params, torch_params(model), strict=True):
        assert_close(p, tp, 1e-5, f"{name} after {cfg.steps} steps")
    # and the run really moved the parameters (an untrained model would not pass above)
    moved = max(float(np.abs(p - q).max()) for p, q in zip(params, init_params(cfg.layers, cfg.seed), strict=True))
    assert moved > cfg.lr
