"""What rank 0 prints and writes: the banner, progress lines, per-rank memory and traffic
against the formulas, and the ``--metrics-json`` document."""
import hashlib
import json

import numpy as np

from ..corpus import bits
from . import activations, traffic
from .memory import CATEGORIES, device_total, optimizer_bytes, predicted

DIMS = ("dp", "cp", "pp", "tp", "tied")
GROUP_OF = {"dp": "data", "cp": "cp", "pp": "pp", "tp": "tp", "tied": "tied"}


def dimension_groups(mesh):
    """The communicator that carries each dimension's traffic on this rank (if any)."""
    return {dim: mesh.group(GROUP_OF[dim]) for dim in DIMS if mesh.group(GROUP_OF[dim]) is not None}


# -- text -------------------------------------------------------------------------------------
def banner(job):
    cfg, mesh, strategy = job.cfg, job.mesh, job.strategy
    what = (f"{len(cfg.layers) - 1}-layer MLP {list(cfg.layers)}" if cfg.model == "mlp" else
            f"GPT (n_layer {cfg.n_layer}, n_head {cfg.n_head}, d_model {cfg.d_model}, seq_len {cfg.seq_len}, "
            f"vocab {cfg.vocab}) on {getattr(job.dataset, 'source', cfg.data)}")
    extras = ["sp" if cfg.sp else "", "recompute" if cfg.recompute else "",
              f"{cfg.schedule} × {cfg.micro_batches} micro-batches" if cfg.pp > 1 else ""]
    return (f"ringcomm.train: {cfg.strategy}{' + offload' if cfg.offload else ''}, {cfg.precision}, "
            f"{job.meta.world_size} rank(s) as {mesh.name}{''.join(', ' + x for x in extras if x)}; {strategy.layout.num_params} parameters on rank 0, "
            f"global batch {cfg.batch_size}, {cfg.steps} steps\n"
            f"ringcomm.train: {what}")


def progress(job, step, loss, steps_per_s):
    cfg = job.cfg
    scale = f"  loss scale {job.strategy.scaler.scale:g}" if job.strategy.mixed else ""
    if cfg.model == "gpt":
        rate = steps_per_s * cfg.batch_size * cfg.seq_len
        return f"step {step + 1:>5}/{cfg.steps}  loss {loss:.4f} ({bits(loss):.3f} bits/char)  {rate:8.0f} tokens/s{scale}"
    return f"step {step + 1:>5}/{cfg.steps}  loss {loss:.4f}  {steps_per_s * cfg.batch_size:8.0f} samples/s{scale}"


def summary(job, document, step_time):
    if job.cfg.model == "gpt":
        return (f"final loss {document['final_loss']}, held-out {document['held_out_bits_per_char']:.3f} bits/char "
                f"(unigram entropy of the training text {document['unigram_bits']:.3f}); "
                f"median step {step_time * 1e3:.1f} ms")
    return (f"final loss {document['final_loss']}, accuracy {document['accuracy']:.3f} on "
            f"{len(job.dataset.y_test)} held-out samples (chance {1 / job.cfg.layers[-1]:.3f}); "
            f"median step {step_time * 1e3:.1f} ms")


# -- numbers from every rank ---------------------------------------------------------------------
def gather_per_rank(job, groups, steps, step_time, idle_fraction):
    """Every rank's numbers, gathered to all ranks (one fixed-size float64 vector each)."""
    mesh, strategy, cfg = job.mesh, job.strategy, job.cfg
    steps = max(steps, 1)
    stats = {dim: g.stats() for dim, g in groups.items()}
    formula = traffic.predicted(cfg, mesh, job.stage, strategy)
    p, m = mesh.pp, cfg.micro_batches
    attention = job.stage.gpt.ctx.attention if job.stage.gpt is not None else None
    values = {"rank": job.rank, "d": mesh.d, "c": mesh.c, "p": mesh.p, "t": mesh.t,
              "num_params": strategy.layout.num_params,
              **{f"mem_{c}": v for c, v in job.registry.current().items()},
              **{f"formula_{c}": v for c, v in strategy.predicted_bytes(strategy.rank).items()},
              "peak_model_state_bytes": job.registry.peak_total(),
              "model_state_traced_bytes": job.state_traced,
              "bytes_sent": sum(s["bytes_sent"] for s in stats.values()),
              "bytes_received": sum(s["bytes_received"] for s in stats.values()),
              **{f"{dim}_bytes_sent_per_step": stats[dim]["bytes_sent"] / steps if dim in stats else 0.0
                 for dim in DIMS},
              **{f"{dim}_bytes_predicted_per_step": formula[dim] for dim in DIMS},
              "step_time_s": step_time, "bubble_fraction": idle_fraction,
              "bubble_formula": (p - 1) / (m + p - 1), "peak_activation_bytes": job.watch.peak,
              "peak_steps_watched": job.watch.watched,
              "saved_activation_bytes": job.runner.saved_peak,
              "cp_compute_s_per_step": getattr(attention, "compute_s", 0.0) / steps,
              "cp_wait_s_per_step": getattr(attention, "wait_s", 0.0) / steps,
              "activation_formula_bytes": activations.predicted(cfg, mesh, job.stage, strategy.dtype.itemsize)}
    mine = np.array(list(values.values()), np.float64)
    everyone = np.empty(len(mine) * job.meta.world_size)
    job.meta.all_gather(everyone, mine)
    rows = []
    for vec in everyone.reshape(job.meta.world_size, -1):
        v = dict(zip(values, vec, strict=True))
        ints = ("rank", "d", "c", "p", "t", "num_params", "bytes_sent", "bytes_received",
                "peak_model_state_bytes", "model_state_traced_bytes", "peak_activation_bytes", "saved_activation_bytes",
                "activation_formula_bytes", "peak_steps_watched")
        row = {k: int(v[k]) for k in ints}
        for k in ("model_state_traced_bytes", "peak_activation_bytes"):
            row[k] = None if row[k] < 0 else row[k]  # on a GPU: device memory, not traced
        row.update({k: float(v[k]) for k in values if k not in ints and not k.startswith(("mem_", "formula_"))})
        row["model_state_bytes"] = {c: int(v[f"mem_{c}"]) for c in CATEGORIES}
        row["predicted_model_state_bytes"] = {c: float(v[f"formula_{c}"]) for c in CATEGORIES}
        row["bytes_sent_per_step"] = v["bytes_sent"] / steps
        row["predicted_bytes_sent_per_step"] = sum(v[f"{dim}_bytes_predicted_per_step"] for dim in DIMS)
        rows.append(row)
    return rows


def param_sha256(params):
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p, np.float32).tobytes())
    return h.hexdigest()


def metrics(job, losses, quality, params, per_rank):
    cfg, strategy, mesh = job.cfg, job.strategy, job.mesh
    document = {
        "model": cfg.model, "strategy": strategy.name, "world_size": job.meta.world_size,
        "layout": {"dp": mesh.dp, "cp": mesh.cp, "pp": mesh.pp, "tp": mesh.tp},
        "sp": cfg.sp, "recompute": cfg.recompute, "schedule": cfg.schedule, "micro_batches": cfg.micro_batches,
        "precision": cfg.precision, "offload": cfg.offload, "optimizer": cfg.optimizer, "layers": cfg.layers,
        "steps": len(losses), "losses": losses, "final_loss": losses[-1] if losses else None,
        "accuracy": quality if cfg.model == "mlp" else None,
        "num_params": int(sum(p.size for p in params)), "param_sha256": param_sha256(params),
        "loss_scale": strategy.scaler.scale, "skipped_steps": strategy.scaler.skipped,
        "predicted_bytes": per_rank[0]["predicted_model_state_bytes"], "per_rank": per_rank,
    }
    if cfg.model == "gpt":
        document.update(held_out_bits_per_char=quality, unigram_bits=job.dataset.unigram_bits,
                        gpt={k: getattr(cfg, k) for k in ("n_layer", "n_head", "d_model", "seq_len", "vocab")})
    return document


# -- tables -------------------------------------------------------------------------------------
def _mib(x):
    return f"{x / 2 ** 20:9.3f}"


def _traced(value, unit, digits):
    """A traced byte count in ``unit``s, or n/a (device memory, not traced)."""
    return f"{'n/a':>9}" if value is None else f"{value / unit:9.{digits}f}"


def table(job, per_rank):
    """Per rank: model-state memory and bytes sent per step, measured against the formulas;
    with model parallelism also each dimension's bytes and the activation peak."""
    strategy, cfg = job.strategy, job.cfg
    e = strategy.dtype.itemsize
    phis = sorted({row["num_params"] for row in per_rank})
    lines = [f"model state per rank (MiB; measured / formula; traced: what the strategy allocated, as "
             f"tracemalloc saw it), Φ = {'/'.join(map(str, phis))} parameters "
             f"on a rank, N = {strategy.n} (data group), {e}-byte params and grads, K = {strategy.k_bytes()}"
             + (f"; optimizer includes the copy of the ring predecessor's shard (--elastic): "
                f"{4 + strategy.optimizer.state_bytes}·Φ/N" if getattr(strategy, "mirrored", False) else ""),
             f"{'rank':>4} {'params':>19} {'grads':>19} {'optimizer':>19} {'total':>19} {'peak':>9}"
             f" {'sent/step KiB':>22} {'traced':>9}"]
    for row in per_rank:
        m, f = row["model_state_bytes"], row["predicted_model_state_bytes"]
        cells = [f"{_mib(m[c])}/{_mib(f[c])}" for c in ("params", "grads")]
        cells.append(f"{_mib(m['optimizer'] + m['optimizer_host'])}/{_mib(f['optimizer'] + f['optimizer_host'])}")
        cells.append(f"{_mib(device_total(m))}/{_mib(device_total(f))}")
        sent = f"{row['bytes_sent_per_step'] / 1024:10.1f}/{row['predicted_bytes_sent_per_step'] / 1024:10.1f}"
        lines.append(f"{row['rank']:>4} " + " ".join(cells)
                     + f" {_mib(row['peak_model_state_bytes'])} {sent} {_traced(row['model_state_traced_bytes'], 2 ** 20, 3)}")
    if cfg.offload:
        lines.append("optimizer state is offloaded to host memory: it is not part of the device total")
    if strategy.name.startswith("zero"):
        phi = per_rank[0]["num_params"]
        # DDP keeps an fp32 master only in mixed precision, and its state on the device
        ddp_k = optimizer_bytes(strategy.mixed, strategy.optimizer.state_bytes)
        ddp = device_total(predicted("ddp", phi, strategy.n, e, e, ddp_k))
        mine = device_total(per_rank[0]["predicted_model_state_bytes"])
        lines.append(f"DDP would need {_mib(ddp).strip()} MiB on rank 0 for the same parameters; "
                     f"{strategy.name} uses {_mib(mine).strip()} MiB ({ddp / max(1, mine):.1f}x less)")
    if cfg.model_parallel:
        lines.append("bytes sent per step per dimension (KiB; measured / formula); activations saved for "
                     "backward (KiB; counted / formula) and the step's traced peak (activations and "
                     "transients); idle fraction vs (P-1)/(M+P-1)")
        lines.append(f"{'rank':>4} {'d c p t':>8} {'Φ':>9} " + " ".join(f"{d:>19}" for d in DIMS)
                     + f" {'saved act KiB':>19} {'peak KiB':>9} {'idle':>5} {'bubble':>6}")
        for r in per_rank:
            cells = [f"{r[f'{d}_bytes_sent_per_step'] / 1024:9.1f}/{r[f'{d}_bytes_predicted_per_step'] / 1024:9.1f}"
                     for d in DIMS]
            lines.append(f"{r['rank']:>4} {r['d']:>2} {r['c']:>1} {r['p']:>1} {r['t']:>1} {r['num_params']:>9} "
                         + " ".join(cells)
                         + f" {r['saved_activation_bytes'] / 1024:9.1f}/{r['activation_formula_bytes'] / 1024:9.1f}"
                         f" {_traced(r['peak_activation_bytes'], 1024, 1)} {r['bubble_fraction']:5.2f} "
                         f"{r['bubble_formula']:6.2f}")
    return "\n".join(lines)


def write_json(path, document):
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
