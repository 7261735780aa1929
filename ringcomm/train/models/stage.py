"""Which model a rank trains, and which of its layers and parameters live on this rank.

A model is a list of **layers**; each layer names the parameters it uses (indices in model
order) and has ``forward(params, h) -> (out, cache)`` and ``backward(params, cache, dout) ->
(grads, din)``. Pipeline stage p of P holds the layers ``split(0, L, P)[p]`` and every
parameter they use, in model order: its **local** parameters. A parameter used on two stages
(GPT's tied ``wte``: the embedding on the first, the head on the last) is **tied**: both
stages hold a copy and sum their gradients over the mesh's tied group before the update.

>>> stage = build(cfg, mesh, np.float32)      # gpt, pp2: stage 0 holds wte, wpe, h0.*
>>> [stage.specs[g].name for g in stage.local][:2]
['wte', 'wpe']
"""
from dataclasses import dataclass

import numpy as np

from ...algorithms.chunks import split
from .gpt import GPT, Context, GPTShape, gpt_init, gpt_specs
from .mlp import init_params, mlp_layers, mlp_loss, mlp_specs


@dataclass
class StageModel:
    kind: str          # "mlp" or "gpt"
    specs: list        # every parameter of the model (this tp rank's pieces), model order
    layers: list       # this stage's layers, in forward order
    local: list        # model-order indices of the parameters this stage holds
    tied: set          # of those, the ones another stage holds too
    gpt: object        # the GPT (its context) or None
    seq_len: int       # positions per sequence (1 for the MLP)
    offset: int        # the model-order index of this stage's first layer
    uneven_tp: bool    # the tp ranks' pieces differ in size (an MLP width tp does not divide)

    def layer_members(self):
        """Per layer, the local indices of its parameters (in the layer's order)."""
        where = {g: i for i, g in enumerate(self.local)}
        return [[where[g] for g in layer.params] for layer in self.layers]

    def copies(self):
        """Local indices of parameters that another rank holds a copy of under a different
        flat layout: tied parameters, and parameters replicated over tp when the tp ranks'
        pieces differ in size (an MLP width that does not divide by tp). Each gets a unit of
        its own, so its copies are reduced alike and stay bitwise equal."""
        return [i for i, g in enumerate(self.local)
                if g in self.tied or (self.uneven_tp and self.specs[g].replicated)]

    def local_specs(self):
        return [self.specs[g] for g in self.local]

    def init_local(self, full):
        """This rank's fp32 pieces of the full model-order parameters ``full``."""
        return [self.specs[g].shard(full[g]) for g in self.local]

    def batch(self, x, y):
        """This rank's part of its data rank's sequences: the positions of its cp spans."""
        if self.gpt is None:
            return x, y
        pos = self.gpt.ctx.positions
        return x[:, pos], y[:, pos]

    def loss(self, logits, y, denominator):
        if self.gpt is None:
            return mlp_loss(logits, y, denominator)
        return self.gpt.loss(logits, y, denominator)

    def boundary_shape(self, rows):
        """Shape of the activation entering this stage for a micro-batch of ``rows``."""
        if self.gpt is None:
            return (rows, self.layers[0].split.in_local)
        return (rows, self.gpt.ctx.row_count, self.gpt.shape.d_model)

    @property
    def loss_rows_split(self):
        """Whether tp ranks compute the loss of different rows (sequence parallelism)."""
        return self.gpt is not None and self.gpt.ctx.regions.sp


def gpt_shape(cfg):
    return GPTShape(cfg.vocab, cfg.seq_len, cfg.d_model, cfg.n_head, cfg.n_layer)


def full_init(cfg):
    """The full fp32 parameters in model order, from ``cfg.seed``."""
    return init_params(cfg.layers, cfg.seed) if cfg.model == "mlp" else gpt_init(gpt_shape(cfg), cfg.seed)


def full_specs(cfg):
    return mlp_specs(cfg.layers) if cfg.model == "mlp" else gpt_specs(gpt_shape(cfg))


def build(cfg, mesh, dtype):
    tp_group = mesh.group("tp") if mesh.tp > 1 else None
    gpt = None
    if cfg.model == "mlp":
        tp_specs = [mlp_specs(cfg.layers, mesh.tp, t) for t in range(mesh.tp)]
        every = mlp_layers(cfg.layers, tp_group, dtype)
        seq_len = 1
    else:
        shape = gpt_shape(cfg)
        ctx = Context(shape, tp_group, mesh.group("cp") if mesh.cp > 1 else None, cfg.sp, dtype)
        gpt = GPT(shape, ctx)
        tp_specs = [gpt_specs(shape, mesh.tp, t) for t in range(mesh.tp)]
        every, seq_len = gpt.layers, shape.seq_len
    specs = tp_specs[mesh.t]
    uneven_tp = len({tuple(s.local_shape for s in specs) for specs in tp_specs}) > 1
    stages = [every[lo:hi] for lo, hi in split(0, len(every), mesh.pp)]
    holders = {}
    for p, layers in enumerate(stages):
        for layer in layers:
            for g in layer.params:
                holders.setdefault(g, set()).add(p)
    layers = stages[mesh.p]
    offset = split(0, len(every), mesh.pp)[mesh.p][0]
    local = sorted({g for layer in layers for g in layer.params})
    tied = {g for g in local if len(holders[g]) > 1}
    return StageModel(cfg.model, specs, layers, local, tied, gpt, seq_len, offset, uneven_tp)


def counted(stage, mesh):
    """Per local parameter, whether this rank's copy counts in a global sum over the whole
    job (the gradient norm, the assembled model): a piece replicated over tp counts on tp
    rank 0 only, a tied parameter on the first stage only."""
    return np.array([(not stage.specs[g].replicated or mesh.t == 0) and (g not in stage.tied or mesh.first_stage)
                     for g in stage.local], bool)
