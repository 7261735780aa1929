"""What rank 0 prints and writes at the end of training: per-rank memory and traffic against
the formulas, and the ``--metrics-json`` document."""
import hashlib
import json

import numpy as np

from ..memory import CATEGORIES, device_total, predicted

PER_RANK_FIELDS = [f"mem_{c}" for c in CATEGORIES] + ["peak", "bytes_sent", "bytes_received", "step_time_s"]


def gather_per_rank(meta, strategy, registry, stats, steps, step_time):
    """Every rank's numbers, gathered to all ranks (one fixed-size float64 vector each)."""
    mine = np.array([registry.current()[c] for c in CATEGORIES] +
                    [registry.peak_total(), stats["bytes_sent"], stats["bytes_received"], step_time],
                    np.float64)
    everyone = np.empty(len(mine) * meta.world_size)
    meta.all_gather(everyone, mine)
    rows = []
    for rank, vec in enumerate(everyone.reshape(meta.world_size, -1)):
        rows.append({
            "rank": rank,
            "model_state_bytes": {c: int(vec[i]) for i, c in enumerate(CATEGORIES)},
            "peak_model_state_bytes": int(vec[len(CATEGORIES)]),
            "bytes_sent": int(vec[len(CATEGORIES) + 1]),
            "bytes_received": int(vec[len(CATEGORIES) + 2]),
            "bytes_sent_per_step": vec[len(CATEGORIES) + 1] / max(steps, 1),
            "predicted_bytes_sent_per_step": strategy.predicted_sent_per_step(rank),
            "predicted_model_state_bytes": strategy.predicted_bytes(rank),
            "step_time_s": float(vec[len(CATEGORIES) + 3]),
        })
    return rows


def param_sha256(params):
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p, np.float32).tobytes())
    return h.hexdigest()


def metrics(strategy, cfg, losses, accuracy, params, per_rank):
    return {
        "strategy": strategy.name, "world_size": strategy.n, "precision": cfg.precision,
        "offload": cfg.offload, "optimizer": cfg.optimizer, "layers": cfg.layers,
        "steps": len(losses), "losses": losses, "final_loss": losses[-1] if losses else None,
        "accuracy": accuracy, "num_params": strategy.layout.num_params,
        "param_sha256": param_sha256(params),
        "loss_scale": strategy.scaler.scale, "skipped_steps": strategy.scaler.skipped,
        "predicted_bytes": strategy.predicted_bytes(0), "per_rank": per_rank,
    }


def _mib(x):
    return f"{x / 2 ** 20:9.3f}"


def table(strategy, per_rank):
    """The per-rank memory and traffic table, measured against the formulas."""
    e = strategy.dtype.itemsize
    lines = [f"model state per rank (MiB; measured / formula), Φ = {strategy.layout.num_params} "
             f"parameters, N = {strategy.n}, {e}-byte params and grads, K = {strategy.k_bytes()}",
             f"{'rank':>4} {'params':>19} {'grads':>19} {'optimizer':>19} {'total':>19} {'peak':>9}"
             f" {'sent/step KiB':>22}"]
    for row in per_rank:
        m, f = row["model_state_bytes"], row["predicted_model_state_bytes"]
        opt_m = m["optimizer"] + m["optimizer_host"]
        opt_f = f["optimizer"] + f["optimizer_host"]
        cells = [f"{_mib(m[c])}/{_mib(f[c])}" for c in ("params", "grads")]
        cells.append(f"{_mib(opt_m)}/{_mib(opt_f)}")
        cells.append(f"{_mib(device_total(m))}/{_mib(device_total(f))}")
        sent = f"{row['bytes_sent_per_step'] / 1024:10.1f}/{row['predicted_bytes_sent_per_step'] / 1024:10.1f}"
        lines.append(f"{row['rank']:>4} " + " ".join(cells) + f" {_mib(row['peak_model_state_bytes'])} {sent}")
    if strategy.cfg.offload:
        lines.append("optimizer state is offloaded to host memory: it is not part of the device total")
    if strategy.name.startswith("zero"):
        ddp = predicted("ddp", strategy.layout.num_params, strategy.n, e, e, strategy.k_bytes())
        lines.append(f"DDP would need {_mib(device_total(ddp)).strip()} MiB per rank for the same model; "
                     f"{strategy.name} uses {_mib(device_total(per_rank[0]['predicted_model_state_bytes'])).strip()} "
                     f"MiB ({device_total(ddp) / max(1, device_total(per_rank[0]['predicted_model_state_bytes'])):.1f}x less)")
    return "\n".join(lines)


def write_json(path, document):
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
