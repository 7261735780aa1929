"""The GPT's hand-written forward and backward against PyTorch autograd (float64 oracle),
and the pieces they are built of: block-wise attention in any order equals full causal
attention, zigzag spans balance the causal work, the corpus is real text."""
import math

import numpy as np
import pytest

from ringcomm.train.models import functional as F
from ringcomm.train.models.attention import Accumulator, LocalAttention, block_backward, zigzag_spans
from ringcomm.train.corpus import stdlib_corpus, unigram_bits, windows
from ringcomm.train.models.gpt import GPT, Context, GPTShape, gpt_init, gpt_specs

torch = pytest.importorskip("torch")
TF = torch.nn.functional

pytestmark = pytest.mark.timeout(120)

SHAPE = GPTShape(vocab=40, seq_len=12, d_model=24, n_head=4, n_layer=2)


def perturbed_params(shape, seed=0):
    """GPT-2 initialisation plus noise, so biases and LayerNorms are not trivially 0 and 1."""
    rng = np.random.default_rng(seed)
    return [p + rng.normal(0, 0.1, p.shape).astype(np.float32) for p in gpt_init(shape, seed)]


def ours(shape, params, x, y):
    model = GPT(shape, Context(shape))
    h, caches = x, []
    for layer in model.layers:
        h, cache = layer.forward([params[g] for g in layer.params], h)
        caches.append(cache)
    loss, d = model.loss(h, y, y.size)
    grads = [np.zeros_like(p) for p in params]
    for layer, cache in zip(reversed(model.layers), reversed(caches), strict=True):
        g, d = layer.backward([params[i] for i in layer.params], cache, d)
        for i, gi in zip(layer.params, g, strict=True):
            grads[i] += gi
    return loss, grads


def theirs(shape, params, x, y):
    """The same model written with torch's own modules' functions, differentiated by autograd."""
    P = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params]
    V, T, d, H = shape.vocab, shape.seq_len, shape.d_model, shape.n_head
    X, Y = torch.tensor(x), torch.tensor(y)
    B = x.shape[0]
    h = P[0][X] + P[1][:T]
    for i in range(shape.n_layer):
        ln1w, ln1b, wqkv, bqkv, wo, bo, ln2w, ln2b, win, bin_, wout, bout = P[2 + 12 * i:14 + 12 * i]
        q, k, v = (TF.layer_norm(h, (d,), ln1w, ln1b, 1e-5) @ wqkv + bqkv).split(d, -1)
        q, k, v = (t.view(B, T, H, d // H).transpose(1, 2) for t in (q, k, v))
        att = TF.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        h = h + att @ wo + bo
        h = h + TF.gelu(TF.layer_norm(h, (d,), ln2w, ln2b, 1e-5) @ win + bin_, approximate="tanh") @ wout + bout
    logits = TF.layer_norm(h, (d,), P[-2], P[-1], 1e-5) @ P[0].T
    loss = TF.cross_entropy(logits.reshape(-1, V), Y.reshape(-1))
    loss.backward()
    return loss.item(), [p.grad.numpy() for p in P]


def test_specs_names_order_and_shapes():
    names = [s.name for s in gpt_specs(SHAPE)]
    block = ["ln1.w", "ln1.b", "attn.w_qkv", "attn.b_qkv", "attn.w_o", "attn.b_o", "ln2.w", "ln2.b",
             "mlp.w_in", "mlp.b_in", "mlp.w_out", "mlp.b_out"]
    assert names == ["wte", "wpe"] + [f"h{i}.{n}" for i in range(2) for n in block] + ["lnf.w", "lnf.b"]
    shapes = {s.name: s.shape for s in gpt_specs(SHAPE)}
    assert shapes["wte"] == (40, 24) and shapes["wpe"] == (12, 24)
    assert shapes["h1.attn.w_qkv"] == (24, 72) and shapes["h0.mlp.w_in"] == (24, 96)
    assert shapes["h0.mlp.w_out"] == (96, 24) and shapes["h0.attn.w_o"] == (24, 24)


def test_init_is_gpt2s_and_deterministic():
    params = dict(zip([s.name for s in gpt_specs(SHAPE)], gpt_init(SHAPE, 3), strict=True))
    again = gpt_init(SHAPE, 3)
    assert all(np.array_equal(a, b) for a, b in zip(params.values(), again, strict=True))
    assert np.all(params["h0.ln1.w"] == 1) and np.all(params["lnf.b"] == 0) and np.all(params["h1.attn.b_qkv"] == 0)
    big = np.concatenate([params[k].ravel() for k in ("wte", "wpe", "h0.attn.w_qkv", "h1.mlp.w_in")])
    assert abs(big.std() - 0.02) < 0.002 and abs(big.mean()) < 0.002


@pytest.mark.parametrize("shape", [SHAPE, GPTShape(vocab=16, seq_len=5, d_model=8, n_head=1, n_layer=1)])
def test_loss_and_gradients_match_pytorch(shape):
    rng = np.random.default_rng(1)
    params = perturbed_params(shape)
    x = rng.integers(0, shape.vocab, (3, shape.seq_len))
    y = rng.integers(0, shape.vocab, (3, shape.seq_len))
    loss, grads = ours(shape, params, x, y)
    want_loss, want = theirs(shape, params, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for spec, got, ref in zip(gpt_specs(shape), grads, want, strict=True):
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{spec.name}: relative error {err}"


def random_qkv(rng, rows, b=2, h=3, dh=5):
    return [rng.standard_normal((b, h, rows, dh)).astype(np.float32) for _ in range(3)]


def full_causal(q, k, v):
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    n = s.shape[-1]
    s = np.where(np.triu(np.ones((n, n), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_online_softmax_over_zigzag_blocks_in_ring_order_equals_full_attention(cp):
    """Every rank's queries, visiting every rank's K/V block in ring order (own block first),
    give exactly full causal attention; block_backward gives its gradients."""
    rng = np.random.default_rng(cp)
    T = 2 * cp * 3
    q, k, v = random_qkv(rng, T)
    want = full_causal(q, k, v)
    spans = [zigzag_spans(T, cp, c) for c in range(cp)]
    rows = [np.concatenate([np.arange(a, b) for a, b in s]) for s in spans]
    do = rng.standard_normal(q.shape).astype(np.float32)
    full = LocalAttention([(0, T)])
    _, cache = full.forward(q, k, v)
    dq_full, dk_full, dv_full = full.backward(cache, do)
    dk_sum, dv_sum = np.zeros_like(k), np.zeros_like(v)
    for c in range(cp):
        qc = q[..., rows[c], :]
        acc = Accumulator(qc, spans[c], 1 / math.sqrt(q.shape[-1]))
        order = [(c - step) % cp for step in range(cp)]
        for o in order:
            acc.add(k[..., rows[o], :], v[..., rows[o], :], spans[o])
        out, lse = acc.finish()
        np.testing.assert_allclose(out, want[..., rows[c], :], rtol=1e-5, atol=1e-6)
        dq = np.zeros_like(qc)
        D = (do[..., rows[c], :] * out).sum(-1, keepdims=True)
        for o in order:
            dk, dv = block_backward(qc, k[..., rows[o], :], v[..., rows[o], :], spans[c], spans[o], lse,
                                    do[..., rows[c], :], D, 1 / math.sqrt(q.shape[-1]), dq)
            dk_sum[..., rows[o], :] += dk
            dv_sum[..., rows[o], :] += dv
        np.testing.assert_allclose(dq, dq_full[..., rows[c], :], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dk_sum, dk_full, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dv_sum, dv_full, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_spans_cover_the_sequence_and_balance_causal_work(cp):
    T = 2 * cp * 4
    spans = [zigzag_spans(T, cp, c) for c in range(cp)]
    covered = sorted(i for s in spans for a, b in s for i in range(a, b))
    assert covered == list(range(T))
    chunk = T // (2 * cp)
    # unmasked (query chunk, key chunk) pairs per rank, over all key blocks: the same for all
    pairs = [sum(1 for qa, _ in s for other in spans for ka, _ in other if ka <= qa) for s in spans]
    assert len(set(pairs)) == 1 and pairs[0] == 2 * cp + 1
    assert all(b - a == chunk for s in spans for a, b in s)
    with pytest.raises(ValueError, match="2·cp"):
        zigzag_spans(T + 1, cp, 0)


def test_layer_norm_gelu_and_cross_entropy_gradients_match_pytorch():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)
    w, b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    y, cache = F.layer_norm_forward(x, w, b)
    dx, dw, db = F.layer_norm_backward(cache, w, dy)
    X, W, B = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    Y = TF.layer_norm(X, (8,), W, B, 1e-5)
    Y.backward(torch.tensor(dy, dtype=torch.float64))
    for got, ref in ((y, Y.detach()), (dx, X.grad), (dw, W.grad), (db, B.grad)):
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)
    g, cache = F.gelu_forward(x)
    X = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    G = TF.gelu(X, approximate="tanh")
    G.backward(torch.tensor(dy, dtype=torch.float64))
    np.testing.assert_allclose(g, G.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(F.gelu_backward(cache, dy), X.grad.numpy(), rtol=1e-4, atol=1e-5)
    logits = rng.standard_normal((3, 4, 7)).astype(np.float32)
    target = rng.integers(0, 7, (3, 4))
    share, grad = F.cross_entropy(logits, target, 24)  # half of a global batch of 24 rows
    L = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    ref = TF.cross_entropy(L.reshape(-1, 7), torch.tensor(target).reshape(-1), reduction="sum") / 24
    ref.backward()
    assert share == pytest.approx(ref.item(), rel=1e-6)
    np.testing.assert_allclose(grad, L.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_corpus_is_real_text_with_next_token_targets():
    corpus = stdlib_corpus(32, max_bytes=1 << 18)
    assert corpus.x.shape[1] == 32 and corpus.x.dtype == np.int64
    assert np.array_equal(corpus.x[:, 1:], corpus.y[:, :-1])
    assert np.array_equal(corpus.x[1:, 0], corpus.y[:-1, -1])  # consecutive windows
    text = bytes(corpus.x[:20].reshape(-1).astype(np.uint8))
    assert b"import" in text or b"def " in text
    assert 3.5 < corpus.unigram_bits < 6.0 and len(corpus.x_test) > 0
    assert unigram_bits(np.array([1, 1, 2, 2])) == pytest.approx(1.0)
    x, y = windows(np.arange(10), 3)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and y[-1].tolist() == [7, 8, 9]


def test_held_out_arrays_come_in_pairs(tmp_path):
    from ringcomm.train.corpus import load_npz
    x = np.zeros((4, 8), np.int64)
    np.savez(tmp_path / "half.npz", x=x, y=x, x_test=x)
    with pytest.raises(ValueError, match="both x_test and y_test"):
        load_npz(str(tmp_path / "half.npz"), 8, 256)
    np.savez(tmp_path / "bad.npz", x=x, y=x[:3])
    with pytest.raises(ValueError, match="differ in shape"):
        load_npz(str(tmp_path / "bad.npz"), 8, 256)
    np.savez(tmp_path / "big.npz", x=x + 300, y=x)
    with pytest.raises(ValueError, match="outside"):
        load_npz(str(tmp_path / "big.npz"), 8, 256)
