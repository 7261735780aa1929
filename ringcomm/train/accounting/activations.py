"""Activation memory: what a pipeline stage keeps between a micro-batch's forward and its
backward, by formula and as counted from the arrays actually held.

Notation: b sequences (samples) per micro-batch, R positions of a sequence on this cp rank,
r = R/T rows outside tensor-parallel regions with ``--sp`` (r = R without), h the width,
h_t = h/T and H_t = H/T the width and heads of this tp rank, V the vocabulary, e the storage
itemsize; caches are float32.

- GPT block: 4·(2·b·r·(h + 1) + 2·b·R·h + 17·b·R·h_t + b·H_t·R) bytes: the two LayerNorms'
  normalised inputs and inverse deviations (r rows: ``--sp`` divides them by T), their
  outputs as the tp region sees them (R rows), q/k/v and the attention output, its row
  log-sum-exp, the merged heads (a view of the output when H_t = 1: 16 instead of 17), and
  the MLP's pre-activation, tanh and GELU output.
- GPT embedding: the micro-batch's tokens, 8·b·R; head: the final LayerNorm's output and cache, 4·b·r·(2h+1),
  and on the last stage the logits' gradient, 4·b·r·V.
- MLP: the stage input and every layer's output, e bytes each element (a column-parallel
  layer's output is split over tp, the last layer's logits gathered), and the logits'
  gradient in fp32.
- ``--recompute``: each layer keeps only its input (a block's residual stream, e·b·r·h).

A stage holds M micro-batches' worth under GPipe and min(P − p, M) under 1F1B.
"""


def _gpt_layer(cfg, mesh, stage, layer, b):
    d, T = cfg.d_model, mesh.tp
    R = cfg.seq_len // mesh.cp
    r = stage.gpt.ctx.row_count
    dl, hl = d // T, cfg.n_head // T
    e = stage.gpt.ctx.dtype.itemsize
    if layer.name == "embedding":
        return 8 * b * R
    if cfg.recompute:
        return e * b * r * d
    if layer.name == "head":
        return 4 * b * r * (2 * d + 1)
    merged = 0 if hl == 1 else 1  # with one head here, the merged heads are a view of the output
    return 4 * (2 * b * r * (d + 1) + 2 * b * R * d + (16 + merged) * b * R * dl + b * hl * R)


def saved_per_micro_batch(cfg, mesh, stage, b, itemsize):
    """Bytes one micro-batch of ``b`` leaves on this stage until its backward."""
    if stage.gpt is not None:
        total = sum(_gpt_layer(cfg, mesh, stage, layer, b) for layer in stage.layers)
        if mesh.last_stage:
            total += 4 * b * stage.gpt.ctx.row_count * cfg.vocab
        return total
    widths = [stage.layers[0].split.in_local]
    for layer in stage.layers:
        split = layer.split
        widths.append(split.out_local if split.output_split else split.fan_out)
    if cfg.recompute:
        widths = widths[:-1]
    total = itemsize * b * sum(widths)
    if mesh.last_stage:
        total += 4 * b * cfg.layers[-1]
    return total


def alive(cfg, mesh):
    """Micro-batches whose activations a stage holds at once."""
    return cfg.micro_batches if cfg.schedule == "gpipe" else min(mesh.pp - mesh.p, cfg.micro_batches)


def predicted(cfg, mesh, stage, itemsize):
    b = cfg.batch_size // mesh.dp // cfg.micro_batches
    return alive(cfg, mesh) * saved_per_micro_batch(cfg, mesh, stage, b, itemsize)


def held_bytes(*objects):
    """Bytes of the distinct arrays inside (nested tuples, lists and dicts of) ``objects``: a
    view counts as the whole array it looks into, once."""
    owners, stack = {}, list(objects)
    while stack:
        obj = stack.pop()
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "nbytes") and hasattr(obj, "base"):
            while getattr(obj, "base", None) is not None and hasattr(obj.base, "nbytes"):
                obj = obj.base
            owners[id(obj)] = obj.nbytes
    return sum(owners.values())
