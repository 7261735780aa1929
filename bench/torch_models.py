"""The trainer's two models written in PyTorch from the same contract, for bench/vs_torch.py:
the same parameters in the same order and layout (``W`` of shape (in, out)), the same maths
(pre-LayerNorm GPT with tanh GELU, causal attention through
``F.scaled_dot_product_attention(is_causal=True)``, the head tied to ``wte``; the MLP with
ReLU between layers), the same mean cross-entropy.

>>> model = build(cfg, ringcomm_params)      # from ringcomm.train's config and initial values
>>> loss = model(torch.from_numpy(x), torch.from_numpy(y))
"""
import torch
import torch.nn.functional as F
from torch import nn

BLOCK_PARAMS = 12  # ln1 (w, b), w_qkv, b_qkv, w_o, b_o, ln2 (w, b), w_in, b_in, w_out, b_out


def _parameters(arrays):
    return [nn.Parameter(torch.from_numpy(a.copy())) for a in arrays]


class Block(nn.Module):
    """One transformer block; its parameters in ringcomm's order."""

    def __init__(self, arrays, n_head):
        super().__init__()
        self.p = nn.ParameterList(_parameters(arrays))
        self.n_head = n_head

    def forward(self, h):
        ln1w, ln1b, wqkv, bqkv, wo, bo, ln2w, ln2b, win, bin_, wout, bout = self.p
        B, T, d = h.shape
        q, k, v = (F.layer_norm(h, (d,), ln1w, ln1b, 1e-5) @ wqkv + bqkv).split(d, -1)
        q, k, v = (t.view(B, T, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        h = h + att @ wo + bo
        return h + F.gelu(F.layer_norm(h, (d,), ln2w, ln2b, 1e-5) @ win + bin_, approximate="tanh") @ wout + bout


class GPT(nn.Module):
    """``wte, wpe``, the blocks, ``lnf``; logits through ``wte.T``."""

    def __init__(self, arrays, n_head, n_layer):
        super().__init__()
        self.wte, self.wpe = _parameters(arrays[:2])
        self.blocks = nn.ModuleList(Block(arrays[2 + BLOCK_PARAMS * i:2 + BLOCK_PARAMS * (i + 1)], n_head)
                                    for i in range(n_layer))
        self.lnf_w, self.lnf_b = _parameters(arrays[-2:])

    def forward(self, x, y):
        T = x.shape[1]
        h = self.wte[x] + self.wpe[:T]
        for block in self.blocks:
            h = block(h)
        logits = F.layer_norm(h, (h.shape[-1],), self.lnf_w, self.lnf_b, 1e-5) @ self.wte.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class MLP(nn.Module):
    """``h = h @ W_i + b_i``, ReLU between layers."""

    def __init__(self, arrays):
        super().__init__()
        self.layers = nn.ModuleList(_Linear(w, b) for w, b in zip(arrays[::2], arrays[1::2], strict=True))

    def forward(self, x, y):
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = torch.relu(h)
        return F.cross_entropy(h, y)


class _Linear(nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = _parameters([w, b])

    def forward(self, h):
        return torch.addmm(self.b, h, self.w)


def build(cfg, arrays):
    """The PyTorch model of ``cfg`` (ringcomm.train's config) holding copies of ``arrays``."""
    if cfg.model == "gpt":
        return GPT(arrays, cfg.n_head, cfg.n_layer)
    return MLP(arrays)


def shard_units(model):
    """The modules FSDP2 shards one by one (then the root): the GPT's blocks, the MLP's layers."""
    return list(model.blocks) if isinstance(model, GPT) else list(model.layers)
