"""Causal softmax attention, block by block, and ring attention over a context-parallel group.

Words used here:

- **span**: a contiguous range of sequence positions ``[start, stop)``. A rank's queries,
  keys and values cover one or more spans (its rows in order).
- **block**: the keys and values of one rank's spans. Full attention is one block; ring
  attention visits the C blocks of a cp group one after another.

Attention over blocks uses the *online softmax*: for each query row a running maximum ``m``,
a running sum ``l`` of ``exp(s − m)`` and a running output, rescaled whenever ``m`` grows, so
visiting the blocks in any order gives exactly softmax attention over all of them. Forward
keeps only the output ``o`` and the row log-sum-exp ``lse = m + log l``; backward rebuilds
each block's probabilities ``P = exp(s − lse)`` and uses ``D = rowsum(dO ∘ O)``:
``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ − D)``, ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``.

**Ring attention** (``cp`` group of C ranks, rank c): the local block first, then C−1 hops,
each rank sending the block it holds to rank c+1 and receiving one from rank c−1 while it
computes on the one it has. Backward sends K, V the same way, and the gradient accumulators
dK, dV of each block after them: a rank keeps its own block's gradients, the accumulator of
block j starts at rank j+1 and travels on, and after the last block a final hop brings it
home to rank j, which adds its own. Bytes sent per rank and layer call, with a block of
``E`` elements (K and V together, ``2·b·(s/C)·h``), all float32 (4 bytes; attention
computes in float32 whatever the storage precision): forward (C−1)·E·4, backward
(C−1)·E·4 + (C−1)·E·4. Every hop is in flight while a block computes: a K/V hop during
the block before it, a dK/dV hop during the next block's gradients (only the last one,
bringing them home, is waited for at once). With the causal mask the sequence is cut
into 2C chunks and rank c holds chunks c and 2C−1−c (:func:`zigzag_spans`): every rank then
computes the same number of unmasked (query chunk, key chunk) pairs, 2C+1.

Shapes: q, k, v, o are ``(batch, heads, rows, head_dim)``.
"""
import functools
import math
import time

import numpy as np

from ...arrays import array_module

KV_TAG, GRAD_TAG = 0, 1


def zigzag_spans(seq_len, cp, c):
    """The two spans rank ``c`` of ``cp`` holds: chunks c and 2·cp−1−c of ``2·cp`` chunks.

    >>> zigzag_spans(8, 2, 0), zigzag_spans(8, 2, 1)
    ([(0, 2), (6, 8)], [(2, 4), (4, 6)])
    """
    if cp == 1:
        return [(0, seq_len)]
    if seq_len % (2 * cp):
        raise ValueError(f"--seq-len {seq_len} must divide into 2·cp = {2 * cp} chunks")
    size = seq_len // (2 * cp)
    return [(c * size, (c + 1) * size), ((2 * cp - 1 - c) * size, (2 * cp - c) * size)]


def span_positions(spans):
    return np.concatenate([np.arange(a, b) for a, b in spans])


def _pieces(spans):
    """(row slice, start, stop) of each span within the rows that hold them in order."""
    out, row = [], 0
    for a, b in spans:
        out.append((slice(row, row + b - a), a, b))
        row += b - a
    return out


@functools.lru_cache(maxsize=16)
def _causal_mask(xp, device, qa, qb, ka, kb):
    """0 where key position ``j`` may be seen by query position ``i`` (j <= i), else −inf:
    added to a block's scores in place (made once per span pair, array module and device;
    a model's attention has a few span pairs)."""
    hidden = np.arange(ka, kb)[None, :] > np.arange(qa, qb)[:, None]
    mask = np.where(hidden, -np.inf, 0.0).astype(np.float32)
    mask.flags.writeable = False  # shared by every call: nothing may write into it
    return mask if xp is np else xp.asarray(mask)


def _scores(q, k, qa, qb, ka, kb, scale):
    """Masked scores of query span [qa, qb) against key span [ka, kb); None if all masked."""
    if ka >= qb:  # every key comes after every query
        return None
    s = q @ k.swapaxes(-1, -2)
    s *= scale
    if kb > qa + 1:  # some key comes after some query
        xp = array_module(s)
        s += _causal_mask(xp, -1 if xp is np else xp.cuda.Device().id, qa, qb, ka, kb)
    return s


class Accumulator:
    """The online softmax of one rank's queries over the blocks visited so far."""

    def __init__(self, q, q_spans, scale):
        xp = array_module(q)
        self.q, self.q_spans, self.scale = q, q_spans, scale
        self.m = xp.full(q.shape[:-1] + (1,), -np.inf, np.float32)
        self.l = xp.zeros(q.shape[:-1] + (1,), np.float32)
        self.o = xp.zeros(q.shape, np.float32)
        self._seen = set()  # query spans that have met a key: the others take a block as it is

    def add(self, k, v, k_spans):
        xp = array_module(k)
        for qs, qa, qb in _pieces(self.q_spans):
            for ks, ka, kb in _pieces(k_spans):
                s = _scores(self.q[..., qs, :], k[..., ks, :], qa, qb, ka, kb, self.scale)
                if s is None:
                    continue
                fresh = qa not in self._seen
                self._seen.add(qa)
                if fresh and ka <= qa:  # the first block these rows see: no rescaling
                    m_new = s.max(axis=-1, keepdims=True)
                    s -= m_new  # key ka <= every query row: each row's maximum is finite
                    xp.exp(s, out=s)
                    self.l[..., qs, :] = s.sum(axis=-1, keepdims=True)
                    self.o[..., qs, :] = s @ v[..., ks, :]
                    self.m[..., qs, :] = m_new
                    continue
                m_old = self.m[..., qs, :]
                m_new = xp.maximum(m_old, s.max(axis=-1, keepdims=True))
                m_safe = xp.where(xp.isfinite(m_new), m_new, 0.0)
                alpha = xp.exp(m_old - m_safe)
                s -= m_safe
                xp.exp(s, out=s)  # the block's probabilities, unnormalised
                self.l[..., qs, :] = self.l[..., qs, :] * alpha + s.sum(axis=-1, keepdims=True)
                self.o[..., qs, :] = self.o[..., qs, :] * alpha + s @ v[..., ks, :]
                self.m[..., qs, :] = m_new

    def finish(self):
        """``(o, lse)``: the attention output and each row's log-sum-exp."""
        return self.o / self.l, self.m + array_module(self.l).log(self.l)


def block_backward(q, k, v, q_spans, k_spans, lse, do, D, scale, dq, out=None):
    """Gradients through one block: adds into ``dq``, returns ``(dk, dv)`` of the block
    (``out``: two zeroed arrays of k's shape to write them into)."""
    xp = array_module(q)
    dk, dv = out if out is not None else (xp.zeros(k.shape, np.float32), xp.zeros(v.shape, np.float32))
    for qs, qa, qb in _pieces(q_spans):
        for ks, ka, kb in _pieces(k_spans):
            s = _scores(q[..., qs, :], k[..., ks, :], qa, qb, ka, kb, scale)
            if s is None:
                continue
            s -= lse[..., qs, :]
            xp.exp(s, out=s)  # P
            dv[..., ks, :] += s.swapaxes(-1, -2) @ do[..., qs, :]
            ds = do[..., qs, :] @ v[..., ks, :].swapaxes(-1, -2)
            ds -= D[..., qs, :]
            ds *= s
            ds *= scale  # once here, not on both products below
            dq[..., qs, :] += ds @ k[..., ks, :]
            dk[..., ks, :] += ds.swapaxes(-1, -2) @ q[..., qs, :]
    return dk, dv


class LocalAttention:
    """Causal attention over this rank's own positions (no context parallelism)."""

    def __init__(self, spans):
        self.spans = spans

    def forward(self, q, k, v):
        acc = Accumulator(q, self.spans, 1.0 / math.sqrt(q.shape[-1]))
        acc.add(k, v, self.spans)
        o, lse = acc.finish()
        return o, (q, k, v, o, lse)

    def backward(self, cache, do):
        q, k, v, o, lse = cache
        dq = array_module(q).zeros(q.shape, np.float32)
        D = (do * o).sum(axis=-1, keepdims=True)
        dk, dv = block_backward(q, k, v, self.spans, self.spans, lse, do, D, 1.0 / math.sqrt(q.shape[-1]), dq)
        return dq, dk, dv


def _pack(k, v):
    """K and V in one contiguous (2, ...) array: one message per hop. (Two copies into an
    empty array: ``stack`` keeps the layout of k's transposed view, and making that
    contiguous would copy twice.)"""
    kv = array_module(k).empty((2, *k.shape), np.float32)
    kv[0], kv[1] = k, v
    return kv


class RingAttention:
    """Ring attention over the cp group ``group`` (see the module docstring). Every rank's
    spans follow from its group rank (:func:`zigzag_spans`), so blocks travel as bare K/V."""

    def __init__(self, group, seq_len):
        self.group, self.cp, self.c = group, group.world_size, group.rank
        self.spans_of = [zigzag_spans(seq_len, self.cp, r) for r in range(self.cp)]
        self.spans = self.spans_of[self.c]
        self.compute_s = self.wait_s = 0.0  # time in block compute, and blocked on a hop

    def _wait(self, works):
        t0 = time.perf_counter()
        for work in works:
            work.wait()
        self.wait_s += time.perf_counter() - t0

    def _ring(self, payload, step, tag):
        """Post this step's hop: send ``payload`` right, receive the next one from the left."""
        right, left = (self.c + 1) % self.cp, (self.c - 1) % self.cp
        incoming = array_module(payload).empty(payload.shape, payload.dtype)
        sent = self.group.send(payload, right, tag=tag, async_op=True)
        got = self.group.recv(incoming, left, tag=tag, async_op=True)
        return incoming, (sent, got)

    def forward(self, q, k, v):
        acc = Accumulator(q, self.spans, 1.0 / math.sqrt(q.shape[-1]))
        kv = _pack(k, v)  # one message per hop
        for step in range(self.cp):
            hop = self._ring(kv, step, KV_TAG) if step < self.cp - 1 else None
            t0 = time.perf_counter()
            acc.add(kv[0], kv[1], self.spans_of[(self.c - step) % self.cp])  # overlaps the hop
            self.compute_s += time.perf_counter() - t0
            if hop is not None:
                self._wait(hop[1])
                kv = hop[0]
        o, lse = acc.finish()
        return o, (q, k, v, o, lse)

    def backward(self, cache, do):
        q, k, v, o, lse = cache
        xp = array_module(q)
        scale = 1.0 / math.sqrt(q.shape[-1])
        dq = xp.zeros(q.shape, np.float32)
        D = (do * o).sum(axis=-1, keepdims=True)
        kv = _pack(k, v)
        own = None         # dK, dV of this rank's own block: they stay here
        travelling = None  # (incoming dK/dV accumulator, its hop) of the block held next
        for step in range(self.cp):
            hop = self._ring(kv, step, KV_TAG) if step < self.cp - 1 else None
            # a block's accumulator starts one rank after its owner: at step 1, written here
            fresh = xp.zeros(kv.shape, np.float32) if step == 1 else None
            t0 = time.perf_counter()
            dk, dv = block_backward(q, kv[0], kv[1], self.spans, self.spans_of[(self.c - step) % self.cp],
                                    lse, do, D, scale, dq, out=None if fresh is None else (fresh[0], fresh[1]))
            self.compute_s += time.perf_counter() - t0
            if step == 0:
                own = dk, dv
            elif fresh is not None:
                travelling = self._ring(fresh, step, GRAD_TAG)
            else:  # the accumulator of this block, sent on while the block above computed
                self._wait(travelling[1])
                grads = travelling[0]
                grads[0] += dk
                grads[1] += dv
                travelling = self._ring(grads, step, GRAD_TAG)  # the last hop brings it home
            if hop is not None:
                self._wait(hop[1])
                kv = hop[0]
        dk, dv = own
        if travelling is not None:
            self._wait(travelling[1])
            grads = travelling[0]
            dk += grads[0]
            dv += grads[1]
        return dq, dk, dv
