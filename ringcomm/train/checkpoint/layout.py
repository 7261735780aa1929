"""Where a rank's saved state sits in the whole model: the checkpoint's **placement** records,
and the assembly of whole parameters from rank files saved on any layout.

A rank of a mesh (DP × CP × PP × TP) holds the **pieces** of the parameters its pipeline
stage uses: a whole parameter, or (tensor parallelism) the indices ``index`` along ``axis``
of it. Inside its data group (the ranks with the same pieces) the pieces live in one flat
buffer under a :class:`ringcomm.train.parallel.flat.Layout`, whole on every rank (``kind``
"full" and "server") or as one shard per rank ("shard").

Assembly, for ``master``, ``m`` and ``v``: the rank files are grouped by (stage, tp rank);
each group's flat buffer is rebuilt from its data ranks' files, cut into pieces, and every
piece is written into its place in the whole parameter. Replicated and tied copies hold the
same values and are written more than once; a parameter element that no piece covers is an
error, never a silent zero.

>>> placement = Placement.of(strategy)          # this rank's record, saved in its rank file
"""
import json
from dataclasses import dataclass, field

import numpy as np

from .files import CheckpointError


def layout_record(layout):
    return {
        "total": layout.total, "shard_total": layout.shard_total,
        "specs": [[name, list(shape)] for name, shape in layout.specs],
        "offsets": list(layout.offsets),
        "units": [{"index": u.index, "params": list(u.params), "start": u.start, "length": u.length,
                   "padded": u.padded, "shard_size": u.shard_size, "shard_start": u.shard_start}
                  for u in layout.units],
    }


@dataclass
class Placement:
    mesh: dict                 # {"dp": D, "cp": C, "pp": P, "tp": T}
    coords: list               # [d, c, p, t]
    data_rank: int             # rank within the data group (d·C + c)
    model: list                # [[name, shape], ...]: every parameter of the model, model order
    pieces: list = field(default_factory=list)   # per local parameter: [name, axis, index or None]

    @classmethod
    def of(cls, strategy):
        """The strategy's own placement; without one, a data-parallel-only layout whose
        pieces are the whole parameters of its layout."""
        if getattr(strategy, "placement", None) is not None:
            return strategy.placement
        specs = [[name, list(shape)] for name, shape in strategy.layout.specs]
        return cls({"dp": strategy.n, "cp": 1, "pp": 1, "tp": 1}, [strategy.rank, 0, 0, 0], strategy.rank,
                   specs, [[name, None, None] for name, _ in specs])

    def record(self, layout):
        return {"mesh": self.mesh, "coords": list(self.coords), "data_rank": self.data_rank,
                "model": self.model, "pieces": self.pieces, "layout": layout_record(layout)}


def encode(record):
    """A JSON record as a plain uint8 array (rank files hold arrays only)."""
    return np.frombuffer(json.dumps(record, sort_keys=True).encode(), np.uint8)


def decode(array):
    return json.loads(bytes(np.asarray(array, np.uint8)).decode())


def full_flat(layout, kind, files, key):
    """The whole padded flat buffer of ``key`` under one data group's ``layout`` record, from
    its rank files in data-rank order."""
    if kind in ("full", "server"):
        return np.asarray(files[0][key], np.float32)
    flat = np.zeros(layout["total"], np.float32)
    for rank, arrays in enumerate(files):
        shard = arrays[key]
        for u in layout["units"]:
            lo = u["start"] + rank * u["shard_size"]
            flat[lo:lo + u["shard_size"]] = shard[u["shard_start"]:u["shard_start"] + u["shard_size"]]
    return flat


def model_order(layout, flat):
    """The arrays (in their shapes) inside a flat buffer, in the layout's parameter order."""
    out = []
    for (_, shape), offset in zip(layout["specs"], layout["offsets"], strict=True):
        size = int(np.prod(shape))
        out.append(flat[offset:offset + size].reshape(shape).copy())
    return out


def _where(shape, axis, index):
    where = [slice(None)] * len(shape)
    if axis is not None:
        where[axis] = np.asarray(index, np.int64)
    return tuple(where)


def assemble(kind, files, key):
    """Every whole parameter of ``key`` (model order), from rank files that each carry a
    ``placement`` record; None when the files do not hold ``key`` (SGD has no m, v)."""
    records = [decode(f["placement"]) for f in files]
    if key not in files[0]:
        return None
    model = records[0]["model"]
    whole = {name: np.zeros(shape, np.float32) for name, shape in model}
    covered = {name: np.zeros(shape, bool) for name, shape in model}
    groups = {}
    for arrays, rec in zip(files, records, strict=True):
        groups.setdefault(tuple(rec["coords"][2:]), []).append((rec["data_rank"], arrays, rec))
    for members in groups.values():
        members.sort(key=lambda m: m[0])
        rec = members[0][2]
        flat = full_flat(rec["layout"], kind, [m[1] for m in members], key)
        for (name, axis, index), piece in zip(rec["pieces"], model_order(rec["layout"], flat), strict=True):
            where = _where(whole[name].shape, axis, index)
            whole[name][where] = piece
            covered[name][where] = True
    missing = [name for name, mask in covered.items() if not mask.all()]
    if missing:
        raise CheckpointError(f"the rank files do not cover parameter(s) {missing}")
    return [whole[name] for name, _ in model]


def local_pieces(placement, model_names, whole):
    """This rank's pieces (its layout's order) cut from whole parameters in model order."""
    by_name = dict(zip(model_names, whole, strict=True))
    return [np.ascontiguousarray(by_name[name][_where(by_name[name].shape, axis, index)])
            for name, axis, index in placement.pieces]
