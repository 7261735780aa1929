"""Bytes one rank sends per training step, per mesh dimension, by formula.

Notation: M micro-batches of b samples (sequences) each, R = s/C positions per sequence on
a cp rank, h the GPT width, e the bytes of a stored activation (2 in fp16, 4 in fp32), T the
tp size, L_here the GPT blocks on this stage; an all-reduce of S bytes costs ``c(S)``
(2(T−1)/T·S on the ring, S·log2 T by recursive doubling: whichever ``auto`` runs, see
:func:`ringcomm.algorithms.choice.all_reduce_bytes`), a ring all-gather or reduce-scatter
of S bytes (T−1)/T·S.

- **tp** (GPT): per block and micro-batch, forward two all-reduces of b·R·h·e and backward
  two more (Megatron-LM); with ``--sp`` each becomes a reduce-scatter plus an all-gather (same
  bytes), and the gradients of the replicated parameters (LayerNorms, output biases,
  embeddings on their stages) are all-reduced in fp32. ``--recompute`` repeats the forward's.
  MLP (:func:`mlp_layer_tp`), per micro-batch of b rows: Σ_row c(b·out·e) + Σ_column, not
  first, c(b·in·e) + (T−1)·b·⌈classes/T⌉·e for a final all-gather of the logits.
- **cp** (GPT): per block and micro-batch, ring attention's K and V blocks, E = 2·b·R·h/T
  fp32 elements: forward (C−1)·E·4, backward (C−1)·E·4 + (C−1)·E·4 (each block's dK and
  dV start one rank after its owner and travel on, home).
- **pp**: per micro-batch, the stage's output activation forward (all stages but the last)
  and its input gradient backward (all but the first).
- **data**: the strategy's own (DDP and ZeRO-1/2: 2(N−1)/N·Φ·e; ZeRO-3: (N−1)/N·e·(2M·Σ
  over layers of the parameters each gathers + Φ); parameter server: (N−1)Φe at rank 0, Φe
  elsewhere), Φ the parameters on this rank; each strategy's ``predicted_sent_per_step``
  calls the function here for its formula.
- **tied**: the first and last stage all-reduce the embedding gradient, V·h fp32.
"""
import math

from ...algorithms.choice import all_reduce_bytes


# -- the data group: what each strategy sends ---------------------------------------------------
def all_reduce_sent(phi, n, e):
    """DDP and ZeRO-1/2: 2(N−1)/N·Φ·e (an all-reduce, or a reduce-scatter and an all-gather)."""
    return 2 * (n - 1) / n * phi * e


def server_sent(phi, n, e, rank):
    """The parameter server: (N−1)Φe from rank 0, Φe from every other rank."""
    return (n - 1) * phi * e if rank == 0 else phi * e


def zero3_sent(phi, n, e, micro_batches, gathered):
    """ZeRO-3: (N−1)/N·e·(2M·Σ_layers Φ_layer + Φ), every layer gathering the units it uses
    (``gathered``: per layer, their parameters) once in each forward and backward of each of
    M micro-batches, and the gradients reduce-scattered once."""
    return (n - 1) / n * e * (2 * micro_batches * sum(gathered) + phi)


# -- model parallelism --------------------------------------------------------------------------
def mlp_layer_tp(layer, rows, itemsize, first, local=False, forward_only=False):
    """Bytes a tp rank sends for one micro-batch of ``rows`` samples through the MLP layer split
    ``layer`` (a :class:`ringcomm.train.parallel.tensor.TPLayer`), forward and backward or the
    forward alone, by the formula of the algorithm ``auto`` picks for each all-reduce
    (``local``: the tp group's ranks share one host's lanes, see ``Communicator.local``)."""
    if layer.tp == 1:
        return 0.0
    total = 0.0
    if layer.kind == "row":
        total += all_reduce_bytes(layer.tp, rows * layer.fan_out * itemsize, local=local)
    elif not first and not forward_only:
        total += all_reduce_bytes(layer.tp, rows * layer.fan_in * itemsize, local=local)
    if layer.kind == "column" and layer.last:
        total += (layer.tp - 1) * rows * max(layer.widths()) * itemsize  # ring all-gather, padded
    return total


def _local(mesh, kind):
    group = mesh.group(kind)
    return bool(group is not None and group.world_size > 1 and group.local)


def _gpt_tp(cfg, mesh, stage, b, e):
    T, d = mesh.tp, cfg.d_model
    if T == 1:
        return 0.0
    local = _local(mesh, "tp")
    S = b * (cfg.seq_len // mesh.cp) * d * e
    blocks = sum(1 for layer in stage.layers if layer.name.startswith("block"))
    names = {layer.name for layer in stage.layers}
    per_region = 2 * (T - 1) / T * S if cfg.sp else all_reduce_bytes(T, S, local=local)
    forward = 2 * blocks * per_region
    total = forward * (2 if cfg.recompute else 1) + 2 * blocks * per_region
    if cfg.sp:  # gradients of replicated parameters, fp32, once per micro-batch and layer
        sizes = [6 * d * 4] * blocks
        if "embedding" in names:
            sizes.append((cfg.vocab + cfg.seq_len) * d * 4)
        if "head" in names:
            sizes.append((2 * d + cfg.vocab * d) * 4)
        total += sum(all_reduce_bytes(T, size, local=local) for size in sizes)
    return total


def _mlp_tp(cfg, mesh, stage, b):
    if mesh.tp == 1:
        return 0.0
    local = _local(mesh, "tp")
    total = 0.0
    for layer in stage.layers:
        tp_layer = layer.split
        total += mlp_layer_tp(tp_layer, b, 4, first=tp_layer.index == 0, local=local)
        if cfg.recompute:
            total += mlp_layer_tp(tp_layer, b, 4, first=tp_layer.index == 0, local=local, forward_only=True)
    return total


def _gpt_cp(cfg, mesh, stage, b):
    C = mesh.cp
    if C == 1:
        return 0.0
    blocks = sum(1 for layer in stage.layers if layer.name.startswith("block"))
    E = 2 * b * (cfg.seq_len // C) * cfg.d_model // mesh.tp
    forward = (C - 1) * E * 4
    backward = 2 * (C - 1) * E * 4
    return blocks * (forward * (2 if cfg.recompute else 1) + backward)


def _pp(cfg, mesh, stage, b, e):
    if mesh.pp == 1:
        return 0.0
    total = 0.0
    if not mesh.last_stage:
        if stage.gpt is not None:
            total += b * stage.gpt.ctx.row_count * cfg.d_model * e
        else:
            last = stage.layers[-1].split
            total += b * (last.out_local if last.output_split else last.fan_out) * e
    if not mesh.first_stage:
        total += math.prod(stage.boundary_shape(b)) * e
    return total


def predicted(cfg, mesh, stage, strategy):
    """``{"dp": ..., "cp": ..., "pp": ..., "tp": ..., "tied": ...}``: bytes per step this rank
    sends by formula (``dp``: the data group, DP and CP ranks together)."""
    m = cfg.micro_batches
    b = cfg.batch_size // mesh.dp // m
    e = strategy.dtype.itemsize
    out = {"dp": strategy.predicted_sent_per_step(strategy.rank), "cp": 0.0, "pp": m * _pp(cfg, mesh, stage, b, e),
           "tp": 0.0, "tied": 0.0}
    if stage.gpt is not None:
        out["tp"] = m * _gpt_tp(cfg, mesh, stage, b, e)
        out["cp"] = m * _gpt_cp(cfg, mesh, stage, b)
        if stage.tied:
            out["tied"] = all_reduce_bytes(2, cfg.vocab * cfg.d_model * 4, local=_local(mesh, "tied"))
    else:
        out["tp"] = m * _mlp_tp(cfg, mesh, stage, b)
    return out
