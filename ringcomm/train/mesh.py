"""The device mesh: how ranks are laid out over data, pipeline and tensor parallelism.

Ranks are numbered with DP outermost, then PP, then TP innermost, as the second source
document prescribes (TP talks the most, so its ranks are neighbours):

    rank = (d · P + p) · T + t        d ∈ [0, D), p ∈ [0, P), t ∈ [0, T)

Each dimension gets its own sub-communicators built with ``new_group``: the **tp** group
of a rank holds the ranks differing only in t, the **pp** group those differing only in p,
the **dp** group those differing only in d.

>>> # 4 ranks as dp2 × tp2: rank 3 is d=1, p=0, t=1; its tp group is [2, 3], dp group [1, 3]
"""
from dataclasses import dataclass


@dataclass
class Mesh:
    dp: int
    pp: int
    tp: int
    d: int
    p: int
    t: int
    dp_group: object
    pp_group: object
    tp_group: object

    @property
    def name(self):
        return f"dp{self.dp}×pp{self.pp}×tp{self.tp}"


def coords(rank, pp, tp):
    return rank // (pp * tp), rank // tp % pp, rank % tp


def rank_of(d, p, t, pp, tp):
    return (d * pp + p) * tp + t


def build(comm, dp, pp, tp):
    """Create every group on every rank (``new_group`` is collective) and keep this rank's."""
    if dp * pp * tp != comm.world_size:
        raise ValueError(f"--dp {dp} × --pp {pp} × --tp {tp} = {dp * pp * tp}, "
                         f"but the world has {comm.world_size} ranks")
    d, p, t = coords(comm.rank, pp, tp)
    mine = {}
    for kind in ("tp", "pp", "dp"):
        for a in range(dp if kind != "dp" else pp):
            for b in range(pp if kind == "tp" else tp):
                if kind == "tp":
                    members = [rank_of(a, b, x, pp, tp) for x in range(tp)]
                elif kind == "pp":
                    members = [rank_of(a, x, b, pp, tp) for x in range(pp)]
                else:
                    members = [rank_of(x, a, b, pp, tp) for x in range(dp)]
                group = comm.new_group(members)
                if group is not None:
                    mine[kind] = group
    return Mesh(dp, pp, tp, d, p, t, mine["dp"], mine["pp"], mine["tp"])
