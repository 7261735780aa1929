"""Saving and resuming the trainer's state (the format: :mod:`ringcomm.train.checkpoint`).

>>> path = save(meta, strategy, cfg, step, losses, "D")     # every rank, collectively
>>> resumed = restore(meta, strategy, cfg, "D")              # the newest intact checkpoint
"""
import hashlib
import io
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

from ...arrays import to_host
from .files import (
    FORMAT, MANIFEST, VERSION, CheckpointError, Entry, remove_stale_temporaries, fsync_dir,
    find_resumable, load_npz, move_aside, npz_bytes, prune, step_dir, write_durable)
from .layout import Placement, assemble, decode, encode, full_flat, layout_record, local_pieces, model_order

_SCALER_KEYS = {"scale": "scaler_scale", "clean": "scaler_clean", "hysteresis": "scaler_hysteresis",
                "skipped": "scaler_skipped"}


@dataclass
class FullState:
    """A checkpoint gathered from all its rank files, independent of any layout."""

    manifest: dict
    params: list        # fp32 master, model order, model shapes
    m: list             # Adam state in model order (None for SGD)
    v: list
    t: int
    scaler: dict
    losses: np.ndarray

    def names(self):
        """Every parameter's name, model order."""
        specs = self.manifest.get("model_specs") or self.manifest["layout"]["specs"]
        return [name for name, _ in specs]

    def flat(self, key):
        """``params``/``m``/``v`` as one flat, unpadded, model-order fp32 vector."""
        return np.concatenate([a.ravel() for a in getattr(self, key)]) if getattr(self, key) else None


def read_full(entry):
    """Rebuild the full fp32 master and optimizer state of a complete checkpoint."""
    manifest = entry.manifest
    files = [load_npz(os.path.join(entry.path, f"rank{r}.npz"), manifest["files"][f"rank{r}.npz"]["sha256"])
             for r in range(manifest["world_size"])]
    if "placement" in files[0]:
        params, m, v = (assemble(manifest["kind"], files, key) for key in ("master", "m", "v"))
    else:  # written before placements were recorded: one data group, whole parameters
        rec, kind = manifest["layout"], manifest["kind"]
        params, m, v = (model_order(rec, full_flat(rec, kind, files, key)) if key in files[0] else None
                        for key in ("master", "m", "v"))
    scaler = {k: files[0][name] for k, name in _SCALER_KEYS.items()}
    return FullState(manifest, params, m, v, int(files[0]["t"]), scaler, files[0]["losses"])


# -- saving -------------------------------------------------------------------------------------
def rank_arrays(strategy, step, losses, seed, rank, world_size):
    arrays = {k: to_host(v) for k, v in strategy.state().items()}
    arrays.update({_SCALER_KEYS[k]: value for k, value in strategy.scaler.state().items()})
    arrays.update(step=np.array(step, np.int64), seed=np.array(seed, np.int64),
                  losses=np.array(losses, np.float64), rank=np.array(rank, np.int64),
                  world_size=np.array(world_size, np.int64),
                  placement=encode(Placement.of(strategy).record(strategy.layout)))
    return arrays


def manifest_for(strategy, cfg, step, digests):
    placement = Placement.of(strategy)
    return {
        "format": FORMAT, "version": VERSION, "step": step,
        "strategy": strategy.name, "offload": bool(cfg.offload), "kind": strategy.checkpoint_kind,
        "world_size": len(digests), "mesh": placement.mesh, "precision": cfg.precision,
        "optimizer": cfg.optimizer, **model_record(cfg),
        "model_specs": placement.model, "num_params": int(sum(np.prod(s) for _, s in placement.model)),
        "seed": cfg.seed, "batch_size": cfg.batch_size, "samples": cfg.samples, "data": cfg.data,
        "lr": cfg.lr, "bucket_mb": cfg.bucket_mb,
        "layout": layout_record(strategy.layout),  # rank 0's; every rank file has its own
        "files": {f"rank{r}.npz": {"sha256": sha, "bytes": size} for r, (sha, size) in enumerate(digests)},
    }


def model_record(cfg):
    """What the model is: the MLP's widths, or the GPT's dimensions."""
    model = getattr(cfg, "model", "mlp")
    if model == "mlp":
        return {"model": "mlp", "layers": list(cfg.layers)}
    return {"model": model, "gpt": {k: getattr(cfg, k) for k in ("n_layer", "n_head", "d_model", "seq_len", "vocab")}}


def save(meta, strategy, cfg, step, losses, root):
    """Write the checkpoint of step ``step`` (called by every rank; ``meta`` spans them all).
    Returns its directory once it is complete on disk."""
    rank, n = meta.rank, meta.world_size
    path = step_dir(root, step)
    os.makedirs(path, exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(path, MANIFEST)):
        os.unlink(os.path.join(path, MANIFEST))  # rewriting a step: it is incomplete until done
        fsync_dir(path)
    # every rank's file is durable once its record (digest, size, ok) has arrived: this
    # gather is the barrier before the manifest
    mine, error = np.zeros(41, np.uint8), None
    try:
        remove_stale_temporaries(path, [f"rank{rank}.npz"] + ([MANIFEST] if rank == 0 else []))
        data = npz_bytes(rank_arrays(strategy, step, losses, cfg.seed, rank, n))
        write_durable(os.path.join(path, f"rank{rank}.npz"), data)
        mine[:32] = np.frombuffer(hashlib.sha256(data).digest(), np.uint8)
        mine[32:40] = np.array([len(data)], np.int64).view(np.uint8)
        mine[40] = 1
    except OSError as e:  # the others must not wait for a file that will never come
        error = e
    everyone = np.empty(41 * n, np.uint8)
    meta.all_gather(everyone, mine)
    records = everyone.reshape(n, 41)
    failed = [r for r in range(n) if not records[r, 40]]
    if failed:
        raise CheckpointError(f"rank(s) {failed} could not write their part of {path}") from error
    status = np.zeros(1, np.int64)
    if rank == 0:
        try:
            digests = [(bytes(rec[:32]).hex(), int(rec[32:40].view(np.int64)[0])) for rec in records]
            manifest = manifest_for(strategy, cfg, step, digests)
            write_durable(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
            fsync_dir(root)  # the step directory's own entry
        except Exception as e:  # noqa: BLE001 - every rank must hear about it, not wait
            status[0], error = 1, e
        if not status[0]:
            try:
                for line in prune(root, step):
                    print(f"ringcomm.checkpoint: {line}", file=sys.stderr)
            except Exception as e:  # noqa: BLE001 - the checkpoint is complete; the others wait
                print(f"ringcomm.checkpoint: warning: could not prune old checkpoints: {e!r}", file=sys.stderr)
    meta.broadcast(status, root=0)
    if status[0]:
        raise CheckpointError(f"rank 0 could not write the manifest of {path}") from error
    return path


# -- resuming -----------------------------------------------------------------------------------
def _current(strategy):
    """This rank's placement record as it reads back from JSON."""
    return json.loads(json.dumps(Placement.of(strategy).record(strategy.layout), sort_keys=True))


def _saved_as_now(manifest, strategy, n, arrays):
    """Whether this rank's file was saved by a rank placed exactly as this one is now."""
    if manifest["world_size"] != n or manifest["kind"] != strategy.checkpoint_kind:
        return False
    if "placement" in arrays:
        return decode(arrays["placement"]) == _current(strategy)
    return manifest["layout"] == json.loads(json.dumps(layout_record(strategy.layout)))


def state_from_full(full, strategy):
    """This rank's ``state()`` under its own layout, cut from a :class:`FullState`."""
    lay, placement = strategy.layout, Placement.of(strategy)
    names = full.names()
    packed = {key: lay.pack(local_pieces(placement, names, getattr(full, key)), np.float32)
              for key in ("params", "m", "v") if getattr(full, key) is not None}
    if strategy.checkpoint_kind == "shard":
        packed = {k: lay.own_shard(v, strategy.rank) for k, v in packed.items()}
    elif strategy.checkpoint_kind == "server" and strategy.rank != 0:
        packed = {k: (v if k == "params" else np.zeros(0, np.float32)) for k, v in packed.items()}
    state = {"master": packed.pop("params"), "t": np.array(full.t)}
    state.update(packed)
    return state


def in_memory(strategy):
    """This rank's whole model state as a :class:`FullState`, from its own memory: for a
    strategy whose every rank holds all of it (``checkpoint_kind`` "full"; see
    :mod:`ringcomm.train.elastic`)."""
    if strategy.checkpoint_kind != "full":
        raise CheckpointError(f"--strategy {strategy.name} holds a shard of the model state per rank: "
                              f"no rank has the whole of it in memory")
    arrays = rank_arrays(strategy, 0, [], 0, strategy.rank, strategy.n)
    params, m, v = (assemble("full", [arrays], key) for key in ("master", "m", "v"))
    scaler = {k: arrays[name] for k, name in _SCALER_KEYS.items()}
    model = decode(arrays["placement"])["model"]
    return FullState({"model_specs": model}, params, m, v, int(arrays["t"]), scaler, np.zeros(0))


def gathered(world, strategy):
    """The whole model state as a :class:`FullState`, put together from the survivors'
    memory after a loss (ZeRO with ``--elastic``, see :mod:`ringcomm.train.elastic`): every
    survivor's own shard, and each lost rank's from the copy its ring successor keeps; called
    on every rank of ``world``, the world shrunk by the loss. Raises :class:`CheckpointError`
    on every rank alike when a lost rank's copy was lost with it."""
    old, alive = strategy.comm.ranks, set(world.ranks)  # the old data group, by data rank
    mine = _prefixed(strategy, strategy.rank, strategy.state())
    if getattr(strategy, "mirrored", False) and old[strategy.pred] not in alive:
        mine.update(_prefixed(strategy, strategy.pred, strategy.copy_state()))
    blob = np.frombuffer(npz_bytes(mine), np.uint8)
    sizes = np.empty(world.world_size, np.int64)
    world.all_gather(sizes, np.array([blob.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:blob.size] = blob
    everyone = np.empty(world.world_size * padded.size, np.uint8)
    world.all_gather(everyone, padded)
    files = {}
    for r, size in enumerate(sizes):
        start = r * padded.size
        with np.load(io.BytesIO(everyone[start:start + int(size)].tobytes()), allow_pickle=False) as z:
            for name in z.files:
                data_rank, key = name.split(".", 1)
                files.setdefault(int(data_rank[1:]), {})[key] = z[name]
    missing = [d for d in range(strategy.n) if d not in files]
    if missing:
        raise CheckpointError(
            f"the model state of rank(s) {[old[d] for d in missing]} is in no survivor's memory: each was "
            f"lost together with the rank after it, which kept its copy; continue from the last checkpoint "
            f"(--resume --checkpoint-dir)")
    ordered = [files[d] for d in range(strategy.n)]
    params, m, v = (assemble("shard", ordered, key) for key in ("master", "m", "v"))
    scaler = {k: ordered[0][name] for k, name in _SCALER_KEYS.items()}
    model = decode(ordered[0]["placement"])["model"]
    return FullState({"model_specs": model}, params, m, v, int(ordered[0]["t"]), scaler, np.zeros(0))


def _prefixed(strategy, data_rank, state):
    """A rank file's arrays for data rank ``data_rank`` holding ``state``, keys prefixed
    ``d<rank>.`` (one blob may carry two ranks' files)."""
    record = Placement.of(strategy).record(strategy.layout)
    record["data_rank"], record["coords"][0] = data_rank, data_rank
    arrays = {k: to_host(v) for k, v in state.items()}
    arrays.update({_SCALER_KEYS[k]: value for k, value in strategy.scaler.state().items()})
    arrays["placement"] = encode(record)
    return {f"d{data_rank}.{k}": v for k, v in arrays.items()}


def load_full(full, strategy):
    """Put the whole state ``full`` into ``strategy`` under its own layout and place (every
    rank at once: loading may communicate)."""
    strategy.load_state(state_from_full(full, strategy))
    strategy.scaler.load_state(full.scaler)


def check_compatible(manifest, cfg):
    """Raise for a checkpoint that cannot continue ``cfg``; return warnings for settings
    that differ but can (the run then no longer replays the original one)."""
    saved = {"model": manifest.get("model", "mlp"), "layers": manifest.get("layers"), "gpt": manifest.get("gpt")}
    for key, mine in model_record(cfg).items():
        if saved[key] != mine:
            raise CheckpointError(f"the checkpoint has {key} {saved[key]} but this run has {mine}")
    for key, mine in (("precision", cfg.precision), ("optimizer", cfg.optimizer)):
        if manifest[key] != mine:
            raise CheckpointError(f"the checkpoint has {key} {manifest[key]} but this run has {mine}")
    return [f"{key} was {manifest[key]}, now {mine}" for key, mine in
            (("seed", cfg.seed), ("batch_size", cfg.batch_size), ("samples", cfg.samples),
             ("data", cfg.data), ("lr", cfg.lr)) if manifest.get(key) != mine]


@dataclass
class Resumed:
    step: int
    losses: list
    path: str
    manifest: dict
    resharded: bool
    notes: list         # rank 0: damaged or unfinished checkpoints skipped (and where they went)


def restore(meta, strategy, cfg, root):
    """Load the newest complete checkpoint in ``root`` into ``strategy`` (called by every
    rank). Returns a :class:`Resumed`, or None when there is none (start fresh)."""
    step, notes = _choose(meta, root)
    if step is None:
        return None
    path = step_dir(root, step)
    manifest, arrays, resharded = _read_own(meta, strategy, cfg, path)
    if not resharded:
        state = {k: arrays[k] for k in ("master", "m", "v", "t") if k in arrays}
        scaler = {k: arrays[key] for k, key in _SCALER_KEYS.items()}
        losses = arrays["losses"]
    else:
        state, scaler, losses = _reshard(meta, strategy, manifest, path)
    strategy.load_state(state)
    strategy.scaler.load_state(scaler)
    return Resumed(step, [float(x) for x in losses], path, manifest, resharded, notes)


def _choose(meta, root):
    """``(step, notes)``: the checkpoint every rank resumes from (None: none, start fresh),
    chosen and verified by rank 0 and broadcast; rank 0's notes say what it skipped."""
    chosen, error, notes = np.array([-1], np.int64), None, []
    if meta.rank == 0:
        try:
            entry, damaged, unfinished = find_resumable(root)
            if entry is None and damaged:  # unfinished writes alone were never checkpoints
                listed = "; ".join(f"{os.path.basename(e.path)}: {e.reason}" for e in damaged + unfinished)
                chosen[0], error = -3, CheckpointError(
                    f"--resume: {root} holds checkpoints but none is complete and intact ({listed}); "
                    f"nothing was changed")
            else:
                chosen[0] = -1 if entry is None else entry.step
                for e in damaged:  # newer than the one resumed: moved aside, never deleted
                    notes.append(f"skipped damaged checkpoint {e.path} ({e.reason}); moved it to "
                                 f"{move_aside(root, e.path)}")
                notes += [f"skipped {e.path} ({e.reason}: a write that never finished)" for e in unfinished]
        except Exception as e:  # noqa: BLE001 - tell the other ranks instead of leaving them waiting
            chosen[0], error = -2, e
    meta.broadcast(chosen, root=0)  # every rank resumes from the one rank 0 verified
    if chosen[0] == -2:
        raise CheckpointError(f"rank 0 could not look for checkpoints in {root}") from error
    if chosen[0] == -3:
        raise error or CheckpointError(f"--resume: rank 0 found checkpoints in {root} but none complete and intact")
    return (None if chosen[0] < 0 else int(chosen[0])), notes


def _read_own(meta, strategy, cfg, path):
    """``(manifest, arrays, resharded)``: this rank's file of the checkpoint at ``path``
    (arrays None when the world size changed), read whole before load_state may
    communicate; every rank raises, or none, and every rank reshards (saved on another
    placement), or none."""
    flags, error, arrays, manifest = np.zeros(2, np.int64), None, None, None
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        check_compatible(manifest, cfg)
        name = f"rank{meta.rank}.npz"
        if manifest["world_size"] == meta.world_size:
            arrays = load_npz(os.path.join(path, name), manifest["files"][name]["sha256"])
        flags[1] = arrays is None or not _saved_as_now(manifest, strategy, meta.world_size, arrays)
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        flags[0], error = 1, e
    meta.all_reduce(flags)  # flags: failed here, saved on another placement
    if flags[0]:
        if error is not None:
            raise error
        raise CheckpointError(f"another rank could not load {path}")
    return manifest, arrays, bool(flags[1])


def _reshard(meta, strategy, manifest, path):
    """``(state, scaler, losses)`` for this rank's place now, from the whole checkpoint."""
    failed, error = np.zeros(1, np.int64), None
    try:
        full = read_full(Entry(manifest["step"], path, complete=True, manifest=manifest))
        state, scaler, losses = state_from_full(full, strategy), full.scaler, full.losses
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        failed[0], error = 1, e
    meta.all_reduce(failed)  # every rank raises, or none
    if failed[0]:
        if error is not None:
            raise error
        raise CheckpointError(f"another rank could not reshard {path}")
    return state, scaler, losses
