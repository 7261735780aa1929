"""The device mesh: how ranks are laid out over data, context, pipeline and tensor
parallelism.

Ranks are numbered with DP outermost, then CP, then PP, then TP innermost, as the second
source document prescribes (TP talks the most, so its ranks are neighbours):

    rank = ((d · C + c) · P + p) · T + t      d < D, c < C, p < P, t < T

Each dimension gets its own sub-communicators built with ``new_group``: a rank's **tp**
group holds the ranks that differ from it only in t, and likewise **pp**, **cp** and **dp**.
The **data** group (ranks differing in d or c, D·C of them) is where parameter gradients are
summed and where ZeRO shards: every rank of it holds the same parameters and sees different
tokens. The **side** group has the data group's members again, for control traffic (results,
reports) that the byte counts leave out. With a tied embedding and P > 1, the **tied** group joins the first and last stage of
a pipeline, which both hold the embedding matrix.

>>> # 8 ranks as dp2 × cp2 × tp2: rank 5 is d=1, c=0, t=1; its tp group is [4, 5], its cp
>>> # group [5, 7], its dp group [1, 5] and its data group [1, 3, 5, 7]
"""
import itertools
from dataclasses import dataclass

DIMS = ("dp", "cp", "pp", "tp")


@dataclass
class Mesh:
    dp: int
    cp: int
    pp: int
    tp: int
    d: int
    c: int
    p: int
    t: int
    groups: dict      # "dp", "cp", "pp", "tp", "data", "side", "tied" -> this rank's communicator

    @property
    def name(self):
        return "×".join(f"{k}{getattr(self, k)}" for k in DIMS)

    @property
    def data_rank(self):
        return self.d * self.cp + self.c

    @property
    def first_stage(self):
        return self.p == 0

    @property
    def last_stage(self):
        return self.p == self.pp - 1

    def group(self, kind):
        return self.groups.get(kind)


def coords(rank, cp, pp, tp):
    """(d, c, p, t) of ``rank``."""
    return rank // (cp * pp * tp), rank // (pp * tp) % cp, rank // tp % pp, rank % tp


def rank_of(d, c, p, t, cp, pp, tp):
    return ((d * cp + c) * pp + p) * tp + t


def _members(sizes, varying, fixed):
    """Ranks whose coordinates equal ``fixed`` except along the ``varying`` dimensions."""
    ranges = [range(sizes[k]) if k in varying else [fixed[k]] for k in DIMS]
    return [rank_of(d, c, p, t, sizes["cp"], sizes["pp"], sizes["tp"])
            for d, c, p, t in itertools.product(*ranges)]


def build(comm, dp, cp, pp, tp, tied=False):
    """Create every group on every rank (``new_group`` is collective) and keep this rank's."""
    if dp * cp * pp * tp != comm.world_size:
        raise ValueError(f"--dp {dp} × --cp {cp} × --pp {pp} × --tp {tp} = {dp * cp * pp * tp}, "
                         f"but the world has {comm.world_size} ranks")
    sizes = dict(dp=dp, cp=cp, pp=pp, tp=tp)
    d, c, p, t = coords(comm.rank, cp, pp, tp)
    kinds = {"tp": ("tp",), "pp": ("pp",), "cp": ("cp",), "dp": ("dp",), "data": ("dp", "cp"),
             "side": ("dp", "cp")}
    groups = {}
    for kind, varying in kinds.items():
        others = [k for k in DIMS if k not in varying]
        seen = set()
        for values in itertools.product(*(range(sizes[k]) for k in others)):
            fixed = dict(zip(others, values, strict=True), **{k: 0 for k in varying})
            members = tuple(_members(sizes, varying, fixed))
            if members in seen:
                continue
            seen.add(members)
            group = comm.new_group(list(members))
            if group is not None:
                groups[kind] = group
    if tied and pp > 1:
        for dd, cc, tt in itertools.product(range(dp), range(cp), range(tp)):
            ends = [rank_of(dd, cc, 0, tt, cp, pp, tp), rank_of(dd, cc, pp - 1, tt, cp, pp, tp)]
            group = comm.new_group(ends)
            if group is not None:
                groups["tied"] = group
    return Mesh(dp, cp, pp, tp, d, c, p, t, groups)
