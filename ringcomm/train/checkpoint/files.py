"""The checkpoint store on disk: durable (atomic) files, verification against the manifest,
finding the newest complete checkpoint, and pruning old ones. The format itself and what a
checkpoint holds are described in :mod:`ringcomm.train.checkpoint`.

>>> write_durable("D/step_000120/rank0.npz", npz_bytes({"master": master}))
>>> newest_complete("D").step                 # 120, once its manifest is written
"""
import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import dataclass

import numpy as np

FORMAT, VERSION = "ringcomm-checkpoint", 1
MANIFEST = "manifest.json"
DAMAGED = "damaged"  # where damaged checkpoints are moved, inside the checkpoint directory
KEEP = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or used; the message says why."""


def step_dir(root, step):
    return os.path.join(root, f"step_{step:06d}")


# -- durable files ---------------------------------------------------------------------------
def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path, data):
    """Write ``data`` (bytes) to ``path`` atomically: temporary name, flush, fsync, rename,
    fsync of the directory. Readers see the old file or the whole new one, never a torn one."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def npz_bytes(arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_npz(path, sha256=None):
    """The arrays of a rank file (no pickle), checked against ``sha256`` when given."""
    with open(path, "rb") as f:
        data = f.read()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path}: contents do not match the manifest's sha256")
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


# -- finding checkpoints ---------------------------------------------------------------------
@dataclass
class Entry:
    step: int
    path: str
    complete: bool
    reason: str = ""          # why it is incomplete
    manifest: dict = None     # when readable


def verify(path, hashes=True):
    """``(manifest, "")`` if the checkpoint in ``path`` is complete, else ``(manifest or None,
    reason)``. ``hashes=False`` checks the files' sizes only (cheap)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None, "no manifest"
    except (OSError, ValueError) as e:
        return None, f"unreadable manifest ({e})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return None, f"not a {FORMAT} v{VERSION} manifest"
    try:
        files = manifest.get("files", {})
        if len(files) != manifest.get("world_size"):
            return manifest, "manifest lists the wrong number of rank files"
        for name, info in files.items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                return manifest, f"{name} is missing"
            if os.path.getsize(file) != info["bytes"] or (hashes and sha256_file(file) != info["sha256"]):
                return manifest, f"{name} does not match its {'sha256' if hashes else 'size'}"
    except (KeyError, TypeError, AttributeError) as e:
        return manifest if isinstance(manifest, dict) else None, f"malformed manifest ({e!r})"
    return manifest, ""


def scan(root, check=True):
    """Every ``step_*`` directory in ``root``, oldest first. ``check=False`` only looks for
    the manifest (no hashing)."""
    entries = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return entries
    for name in names:
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if not match or not os.path.isdir(path):
            continue
        if check:
            manifest, reason = verify(path)
        else:
            present = os.path.isfile(os.path.join(path, MANIFEST))
            manifest, reason = None, "" if present else "no manifest"
        if manifest is not None and manifest.get("step") != int(match.group(1)):
            reason = reason or f"manifest says step {manifest.get('step')}"
        entries.append(Entry(int(match.group(1)), path, complete=not reason, reason=reason, manifest=manifest))
    return sorted(entries, key=lambda e: e.step)


def newest_complete(root):
    """The newest complete checkpoint in ``root`` (hashes checked), or None."""
    return find_resumable(root)[0]


def resolve(path):
    """A checkpoint directory from ``path``: itself if it holds a manifest, else the newest
    complete checkpoint under it."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        manifest, reason = verify(path)
        if reason:
            raise CheckpointError(f"{path}: incomplete checkpoint: {reason}")
        return Entry(manifest["step"], path, complete=True, manifest=manifest)
    entry = newest_complete(path)
    if entry is None:
        raise CheckpointError(f"{path}: no complete checkpoint")
    return entry


def remove_checkpoint(path):
    """Delete a checkpoint directory, manifest first (a half-deleted one is never taken for a
    complete one)."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.exists(manifest):
        os.unlink(manifest)
        fsync_dir(path)
    shutil.rmtree(path)


def remove_stale_temporaries(path, names):
    """Delete temporary files of ``names`` left in ``path`` by a writer that crashed (each rank
    only its own: another rank may be writing its file right now)."""
    names = (names,) if isinstance(names, str) else names
    for file in os.listdir(path):
        base, sep, _ = file.partition(".tmp-")
        if sep and base in names:
            os.unlink(os.path.join(path, file))


def move_aside(root, path):
    """Move a damaged checkpoint directory into ``root/damaged/`` (never deleted: what is left
    of it may still be wanted); returns where it went."""
    aside = os.path.join(root, DAMAGED)
    os.makedirs(aside, exist_ok=True)
    target = os.path.join(aside, os.path.basename(path))
    n = 1
    while os.path.exists(target):
        target = os.path.join(aside, f"{os.path.basename(path)}.{n}")
        n += 1
    os.rename(path, target)
    fsync_dir(aside)
    fsync_dir(root)
    return target


def find_resumable(root):
    """``(entry, damaged, unfinished)``: the newest complete checkpoint in ``root`` (hashes
    checked; None if there is none), the checkpoints newer than it that have a manifest but
    fail their checks (damaged), and those without a manifest (writes that never finished),
    each as an :class:`Entry` with its reason."""
    damaged, unfinished = [], []
    for entry in reversed(scan(root, check=False)):
        manifest, reason = verify(entry.path)
        if not reason and manifest.get("step") != entry.step:
            reason = f"manifest says step {manifest.get('step')}"
        if not reason:
            return Entry(entry.step, entry.path, complete=True, manifest=manifest), damaged, unfinished
        (unfinished if reason == "no manifest" else damaged).append(
            Entry(entry.step, entry.path, complete=False, reason=reason, manifest=manifest))
    return None, damaged, unfinished


def prune(root, current, keep=KEEP):
    """After step ``current`` is complete: keep it and the newest complete checkpoints before
    it (``keep`` in all, hashed); delete older complete ones and unfinished writes (no
    manifest), and any with a later step (left by an earlier attempt: not part of this run's
    history); move damaged ones (a manifest their files no longer match: hashes for those
    kept, sizes for those retired) aside into ``root/damaged/``.
    Returns a line for each directory removed or moved."""
    kept, said = 0, []
    for entry in reversed(scan(root, check=False)):
        if entry.step == current:
            kept += 1
            continue
        if entry.complete and entry.step < current and kept < keep:
            reason = verify(entry.path)[1]  # hashed: it is kept to resume from
            if not reason:
                kept += 1
                continue
        else:
            reason = entry.reason or verify(entry.path, hashes=False)[1]
        if reason and reason != "no manifest":
            said.append(f"moved damaged checkpoint {entry.path} ({reason}) to {move_aside(root, entry.path)}")
        else:
            remove_checkpoint(entry.path)
            if reason:
                said.append(f"removed {entry.path}: {reason} (a write that never finished)")
    fsync_dir(root)
    return said
