"""A small GPT, forward and backward by hand, split over tensor, sequence and context
parallelism.

The model (``V`` vocabulary, ``T`` positions, ``d`` width, ``H`` heads, ``L`` blocks)::

    h = wte[x] + wpe[:T]
    for each block:                                   # pre-LayerNorm
        a   = ln1(h);  qkv = a @ w_qkv + b_qkv        # columns [q | k | v], heads of d/H columns
        h   = h + attention(q, k, v) @ w_o + b_o      # causal softmax, scale 1/sqrt(d/H)
        h   = h + gelu(ln2(h) @ w_in + b_in) @ w_out + b_out     # w_in (d, 4d), tanh GELU
    logits = lnf(h) @ wte.T                           # tied embedding

LayerNorm eps 1e-5 with weight and bias; no dropout. The loss is the mean cross-entropy over
every position of every sequence of the global batch. Initialisation (GPT-2's): normal(0,
0.02) for matrices and embeddings, zero biases, unit LayerNorm weights, drawn in parameter
order from ``seed``.

**Layers**, the unit of pipeline stages and of ZeRO-3 gathers: ``embedding`` (wte, wpe),
``block i`` (its 12 parameters), ``head`` (lnf and the tied wte).

**Tensor parallelism** over T ranks (Megatron-LM): attention is split by heads (tp rank t
holds heads [t·H/T, (t+1)·H/T): those columns of each of q, k and v in ``w_qkv``/``b_qkv``,
and the matching rows of ``w_o``), the MLP by its 4d hidden columns (``w_in``/``b_in``
columns, ``w_out`` rows). ``b_o``, ``b_out``, the LayerNorms and both embeddings are
replicated over tp: every tp rank computes the embedding and the head on its rows (all of
them without ``--sp``, 1/T of them with it); see :mod:`ringcomm.train.parallel.regions`
for what crosses the wire.

**Context parallelism** over C ranks: each holds the positions of its spans
(:func:`.attention.zigzag_spans`) of every sequence; everything but attention is per
position, and attention is :class:`.attention.RingAttention`.
"""
from dataclasses import dataclass

import numpy as np

from ...arrays import array_module
from ..parallel.regions import Regions
from . import functional as F
from .attention import LocalAttention, RingAttention, span_positions, zigzag_spans
from .specs import ParamSpec

HELD_OUT_SEQUENCES = 64  # at most this many held-out sequences in held_out_loss
BLOCK_PARAMS = ("ln1.w", "ln1.b", "attn.w_qkv", "attn.b_qkv", "attn.w_o", "attn.b_o",
                "ln2.w", "ln2.b", "mlp.w_in", "mlp.b_in", "mlp.w_out", "mlp.b_out")


@dataclass(frozen=True)
class GPTShape:
    vocab: int
    seq_len: int
    d_model: int
    n_head: int
    n_layer: int


def gpt_specs(shape, tp=1, t=0):
    """Every parameter in model order, with this tp rank's piece of it."""
    V, T, d, L = shape.vocab, shape.seq_len, shape.d_model, shape.n_layer
    dl = d // tp
    heads = np.concatenate([np.arange(j * d + t * dl, j * d + (t + 1) * dl) for j in range(3)])
    hidden = np.arange(t * 4 * dl, (t + 1) * 4 * dl)
    rows = np.arange(t * dl, (t + 1) * dl)
    specs = [ParamSpec("wte", (V, d)), ParamSpec("wpe", (T, d))]
    for i in range(L):
        shard = {"attn.w_qkv": (1, heads), "attn.b_qkv": (0, heads), "attn.w_o": (0, rows),
                 "mlp.w_in": (1, hidden), "mlp.b_in": (0, hidden), "mlp.w_out": (0, hidden)}
        full = {"ln1.w": (d,), "ln1.b": (d,), "attn.w_qkv": (d, 3 * d), "attn.b_qkv": (3 * d,),
                "attn.w_o": (d, d), "attn.b_o": (d,), "ln2.w": (d,), "ln2.b": (d,),
                "mlp.w_in": (d, 4 * d), "mlp.b_in": (4 * d,), "mlp.w_out": (4 * d, d), "mlp.b_out": (d,)}
        for name in BLOCK_PARAMS:
            axis, index = shard.get(name, (None, None)) if tp > 1 else (None, None)
            specs.append(ParamSpec(f"h{i}.{name}", full[name], axis, index))
    specs += [ParamSpec("lnf.w", (d,)), ParamSpec("lnf.b", (d,))]
    return specs


def gpt_init(shape, seed):
    """The full fp32 parameters in model order (GPT-2's initialisation)."""
    rng = np.random.default_rng(seed)
    params = []
    for spec in gpt_specs(shape):
        leaf = spec.name.rsplit(".", 1)[-1]
        if leaf == "w" and ".ln" in "." + spec.name:       # LayerNorm weight
            params.append(np.ones(spec.shape, np.float32))
        elif len(spec.shape) == 2:                          # matrices and embeddings
            params.append(rng.normal(0.0, 0.02, spec.shape).astype(np.float32))
        else:                                               # biases, LayerNorm biases
            params.append(np.zeros(spec.shape, np.float32))
    return params


class Context:
    """What the layers of one rank need to know about the layout: its tp regions, its
    attention (local or ring), its positions and the rows it computes outside regions."""

    def __init__(self, shape, tp_group=None, cp_group=None, sp=False, dtype=np.float32):
        self.shape = shape
        self.regions = Regions(tp_group, sp, dtype)
        self.dtype = np.dtype(dtype)
        if cp_group is not None and cp_group.world_size > 1:
            self.attention = RingAttention(cp_group, shape.seq_len)
        else:
            self.attention = LocalAttention(zigzag_spans(shape.seq_len, 1, 0))
        self.positions = span_positions(self.attention.spans)    # this rank's positions, in order
        self.rows = self.regions.rows(len(self.positions))        # computed outside tp regions
        self.row_count = self.rows.stop - self.rows.start
        self.heads = shape.n_head // self.regions.tp               # heads on this tp rank


class Embedding:
    name = "embedding"

    def __init__(self, ctx):
        self.ctx, self.params = ctx, [0, 1]
        self._positions = {}  # array module -> the rows' positions there (copied to a device once)

    def positions(self, xp):
        """The positions of this rank's rows, as an index array of ``xp``."""
        if xp not in self._positions:
            self._positions[xp] = xp.asarray(self.ctx.positions[self.ctx.rows])
        return self._positions[xp]

    def forward(self, ps, x):
        """``x``: this rank's tokens ``(b, positions)``; returns ``(b, rows, d)``."""
        wte, wpe = ps
        tokens = x[:, self.ctx.rows]
        h = F.f32(wte)[tokens] + F.f32(wpe)[self.positions(array_module(wpe))]
        return h.astype(self.ctx.dtype), tokens

    def backward(self, ps, tokens, dh):
        wte, wpe = ps
        xp = array_module(dh)
        dh = F.f32(dh)
        dwte = xp.zeros(wte.shape, np.float32)
        d = dh.shape[-1]
        if xp is np:
            np.add.at(dwte, tokens.reshape(-1), dh.reshape(-1, d))
        else:
            import cupyx
            cupyx.scatter_add(dwte, tokens.reshape(-1), dh.reshape(-1, d))
        dwpe = xp.zeros(wpe.shape, np.float32)
        dwpe[self.positions(xp)] = dh.sum(axis=0)
        return self.ctx.regions.sum_partial([dwte, dwpe]), None


class Block:
    def __init__(self, ctx, index):
        self.ctx, self.index = ctx, index
        self.name = f"block {index}"
        self.params = list(range(2 + 12 * index, 2 + 12 * (index + 1)))

    def _heads(self, a):
        """(b, s, H·dh) -> (b, H, s, dh)"""
        b, s, width = a.shape
        return a.reshape(b, s, self.ctx.heads, width // self.ctx.heads).transpose(0, 2, 1, 3)

    def forward(self, ps, h):
        ln1w, ln1b, w_qkv, b_qkv, w_o, b_o, ln2w, ln2b, w_in, b_in, w_out, b_out = ps
        rg, xp = self.ctx.regions, array_module(h)
        h = F.f32(h)
        a, ln1 = F.layer_norm_forward(h, ln1w, ln1b)
        a = rg.enter_forward(a)
        qkv = a @ F.f32(w_qkv)
        qkv += F.f32(b_qkv)
        q, k, v = (self._heads(part) for part in xp.split(qkv, 3, axis=-1))
        o, att_cache = self.ctx.attention.forward(q, k, v)
        att = o.transpose(0, 2, 1, 3).reshape(a.shape[0], a.shape[1], -1)
        h1 = F.residual(h, rg.exit_forward(att @ F.f32(w_o)), b_o)
        m, ln2 = F.layer_norm_forward(h1, ln2w, ln2b)
        m = rg.enter_forward(m)
        u = m @ F.f32(w_in)
        u += F.f32(b_in)
        g, gelu = F.gelu_forward(u)
        out = F.residual(h1, rg.exit_forward(g @ F.f32(w_out)), b_out)
        return out.astype(self.ctx.dtype, copy=False), (ln1, a, att_cache, att, ln2, m, gelu, g)

    def backward(self, ps, cache, dout):
        ln1w, ln1b, w_qkv, b_qkv, w_o, b_o, ln2w, ln2b, w_in, b_in, w_out, b_out = ps
        ln1, a, att_cache, att, ln2, m, gelu, g = cache
        rg = self.ctx.regions
        xp = array_module(dout)
        dh1 = F.f32(dout)
        # MLP: h2 = h1 + exit(g @ w_out) + b_out
        db_out = F.sum_rows(dh1)
        dz = rg.exit_backward(dh1)
        dw_out = F.matmul_weight_grad(g, dz)
        du = F.gelu_backward(gelu, dz @ F.f32(w_out).T)
        db_in = F.sum_rows(du)
        dw_in = F.matmul_weight_grad(m, du)
        dm = rg.enter_backward(du @ F.f32(w_in).T)
        dh, dln2w, dln2b = F.layer_norm_backward(ln2, ln2w, dm)
        dh += dh1
        # attention: h1 = h + exit(att @ w_o) + b_o
        db_o = F.sum_rows(dh)
        dy = rg.exit_backward(dh)
        dw_o = F.matmul_weight_grad(att, dy)
        datt = dy @ F.f32(w_o).T
        do = self._heads(datt)
        dq, dk, dv = self.ctx.attention.backward(att_cache, do)
        b, s, width = datt.shape
        dqkv = xp.empty((b, s, 3 * width), np.float32)
        columns = dqkv.reshape(b, s, 3, self.ctx.heads, width // self.ctx.heads)
        for j, part in enumerate((dq, dk, dv)):  # (b, H, s, dh) into its columns: one copy each
            columns[:, :, j] = part.transpose(0, 2, 1, 3)
        db_qkv = F.sum_rows(dqkv)
        dw_qkv = F.matmul_weight_grad(a, dqkv)
        da = rg.enter_backward(dqkv @ F.f32(w_qkv).T)
        dx, dln1w, dln1b = F.layer_norm_backward(ln1, ln1w, da)
        dh += dx
        dln1w, dln1b, db_o, dln2w, dln2b, db_out = rg.sum_partial([dln1w, dln1b, db_o, dln2w, dln2b, db_out])
        grads = [dln1w, dln1b, dw_qkv, db_qkv, dw_o, db_o, dln2w, dln2b, dw_in, db_in, dw_out, db_out]
        return grads, dh.astype(self.ctx.dtype, copy=False)


class Head:
    """``logits = lnf(h) @ wte.T``: parameters lnf.w, lnf.b and the tied wte."""

    name = "head"

    def __init__(self, ctx):
        n = 2 + 12 * ctx.shape.n_layer
        self.ctx, self.params = ctx, [n, n + 1, 0]

    def forward(self, ps, h):
        lnfw, lnfb, wte = ps
        hf, lnf = F.layer_norm_forward(h, lnfw, lnfb)
        return hf @ F.f32(wte).T, (hf, lnf)

    def backward(self, ps, cache, dlogits):
        lnfw, lnfb, wte = ps
        hf, lnf = cache
        dwte = F.matmul_weight_grad(dlogits, hf)
        dh, dlnfw, dlnfb = F.layer_norm_backward(lnf, lnfw, dlogits @ F.f32(wte))
        grads = self.ctx.regions.sum_partial([dlnfw, dlnfb, dwte])
        return grads, dh.astype(self.ctx.dtype)


class GPT:
    """The layers of the whole model for one rank's layout (:class:`Context`)."""

    def __init__(self, shape, ctx):
        self.shape, self.ctx = shape, ctx
        self.layers = [Embedding(ctx)] + [Block(ctx, i) for i in range(shape.n_layer)] + [Head(ctx)]

    def loss(self, logits, y, denominator):
        """This rank's share of the mean cross-entropy over its rows of ``y`` (b, positions)."""
        return F.cross_entropy(logits, y[:, self.ctx.rows], denominator)


def held_out_loss(shape, params, x, y):
    """Mean cross-entropy (nats) of the fp32 GPT ``params`` on up to 64 held-out sequences."""
    model = GPT(shape, Context(shape))
    x, y = x[:HELD_OUT_SEQUENCES], y[:HELD_OUT_SEQUENCES]
    total = 0.0
    for lo in range(0, len(x), 16):
        h = x[lo:lo + 16]
        for layer in model.layers:
            h = layer.forward([params[g] for g in layer.params], h)[0]
        total += model.loss(h, y[lo:lo + 16], y.size)[0]
    return total
