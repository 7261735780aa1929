"""Where every parameter, gradient and shard lives in the flat buffers.

Words used by the strategies:

- **flat buffer**: one 1-D array holding every parameter (or gradient) of the model, in
  *reverse* model order (``b_last, W_last, ..., b0, W0``) — the order in which backward
  produces gradients, so a group of gradients that become ready together is contiguous.
- **unit**: a contiguous range of the flat buffer that is communicated as one piece, padded
  with zeros to a multiple of N. For DDP and ZeRO-1/2 a unit is a **bucket** (parameters
  collected in reverse order until the bucket size is reached; the first bucket is small so
  that communication starts early); for ZeRO-3 a unit is one **layer** (the parameters it
  is the first layer to use).
- **shard**: rank r's 1/N slice of every unit. A rank's shard buffer is the concatenation of
  its slices of all units, so the optimizer sees one flat fp32 array per rank.

- **countdown**: how many gradients of each unit backward has still to produce; when one
  reaches zero the unit's collective may start (DDP's all-reduce, ZeRO's reduce-scatter).

>>> lay = Layout([("W0", (3, 2)), ("b0", (2,))], world_size=2, unit_bytes=1 << 20, itemsize=4)
>>> [(u.start, u.stop, u.shard_size) for u in lay.units]  # one bucket: b0 then W0, 8 elements
[(0, 8, 4)]
"""
from dataclasses import dataclass

import numpy as np

from ...arrays import array_module, copy_into

FIRST_BUCKET_BYTES = 1 << 20  # PyTorch DDP's first bucket: 1 MiB


@dataclass
class Unit:
    index: int
    params: list            # model-order indices of the parameters it holds, in flat order
    start: int              # flat offset of the unit
    length: int             # elements that are real parameters
    padded: int             # length rounded up to a multiple of N
    shard_size: int         # padded / N: one rank's slice
    shard_start: int        # offset of this unit's slice within a rank's shard buffer

    @property
    def stop(self):
        return self.start + self.padded

    def own_range(self, rank):
        """Rank ``rank``'s slice of this unit, in flat-buffer offsets."""
        size = self.shard_size
        return self.start + rank * size, self.start + (rank + 1) * size


class Layout:
    def __init__(self, specs, world_size, unit_bytes, itemsize, layer_members=None,
                 first_bytes=FIRST_BUCKET_BYTES, alone=()):
        """``specs``: ``(name, shape)`` in model order. ``layer_members`` (ZeRO-3): per layer,
        the indices of the parameters it uses; each parameter joins the unit of the first
        layer that uses it. Without it, units are buckets of ``unit_bytes``. A parameter in
        ``alone`` is a unit by itself: a copy of it that another rank holds under another
        layout (a tied embedding, a replicated bias beside unevenly split weights) then
        goes through exactly the same reductions, element for element, and stays bitwise
        equal to this one."""
        self.specs, self.world_size = specs, world_size
        self.sizes = [int(np.prod(shape)) for _, shape in specs]
        self.num_params = sum(self.sizes)
        self.offsets = [0] * len(specs)
        self.units = []
        order = list(range(len(specs)))[::-1]
        groups = self._groups(order, unit_bytes, itemsize, layer_members, first_bytes, set(alone))
        offset = shard_offset = 0
        for index, members in enumerate(groups):
            length = sum(self.sizes[p] for p in members)
            padded = -(-length // world_size) * world_size if length else world_size
            unit = Unit(index, members, offset, length, padded, padded // world_size, shard_offset)
            cursor = offset
            for p in members:
                self.offsets[p] = cursor
                cursor += self.sizes[p]
            self.units.append(unit)
            offset += padded
            shard_offset += padded // world_size
        self.total = offset                # padded flat length
        self.shard_total = shard_offset    # length of one rank's shard buffer
        self.unit_of_param = {p: u for u in self.units for p in u.params}

    def _groups(self, order, unit_bytes, itemsize, layer_members, first_bytes, alone):
        if layer_members is not None:
            first_use = {}
            for layer, members in enumerate(layer_members):
                for p in members:
                    first_use.setdefault(p, layer)
            groups = []
            for layer in reversed(range(len(layer_members))):
                mine = [p for p in order if first_use[p] == layer]
                groups += [[p] for p in mine if p in alone] + [[p for p in mine if p not in alone]]
            return [g for g in groups if g]
        groups, current, current_bytes = [], [], 0
        for p in order:
            if p in alone:
                if current:
                    groups.append(current)
                    current, current_bytes = [], 0
                groups.append([p])
                continue
            current.append(p)
            current_bytes += self.sizes[p] * itemsize
            cap = min(first_bytes, unit_bytes) if not groups else unit_bytes
            if current_bytes >= cap:
                groups.append(current)
                current, current_bytes = [], 0
        if current:
            groups.append(current)
        return groups

    def views(self, flat):
        """Model-order views of every parameter inside ``flat`` (a full flat buffer)."""
        return [flat[o:o + n].reshape(shape) for o, n, (_, shape) in zip(self.offsets, self.sizes, self.specs, strict=True)]

    def unit_views(self, unit, buffer):
        """Views of ``unit``'s parameters inside ``buffer`` (``unit.padded`` long)."""
        return {p: buffer[self.offsets[p] - unit.start:self.offsets[p] - unit.start + self.sizes[p]]
                .reshape(self.specs[p][1]) for p in unit.params}

    def shard_view(self, shard, unit):
        """``unit``'s slice inside a rank's shard buffer."""
        return shard[unit.shard_start:unit.shard_start + unit.shard_size]

    def pack(self, params, dtype):
        """A new flat buffer holding the model-order ``params``."""
        flat = np.zeros(self.total, dtype)
        for view, value in zip(self.views(flat), params, strict=True):
            view[...] = value
        return flat

    def own_pieces(self, flat, rank):
        """Rank ``rank``'s slice of each unit inside a full flat buffer, in unit order (views:
        the pieces its shard is made of, nothing copied)."""
        return [flat[slice(*u.own_range(rank))] for u in self.units]

    def own_shard(self, flat, rank):
        """Rank ``rank``'s shard, gathered from a full flat buffer (a new array)."""
        return array_module(flat).concatenate(self.own_pieces(flat, rank))

    def scatter_shard(self, shard, flat, rank):
        """Write rank ``rank``'s shard into its places in a full flat buffer."""
        for u in self.units:
            lo, hi = u.own_range(rank)
            copy_into(flat[lo:hi], self.shard_view(shard, u))


class Countdown:
    """The gradients of each unit still to come in one backward pass.

    >>> countdown = Countdown(lay)
    >>> countdown.done(1)       # the unit of parameter 1 if that was its last gradient, else None
    >>> countdown.reset()       # after backward: the next pass counts afresh
    """

    def __init__(self, layout):
        self.layout = layout
        self._left = {}  # unit index -> gradients still to come; empty between passes

    def done(self, p):
        """Count parameter ``p``'s gradient (once per backward pass, however many micro-batches
        added to it); return its unit when that was the unit's last one."""
        if not self._left:
            self._left = {u.index: len(u.params) for u in self.layout.units}
        unit = self.layout.unit_of_param[p]
        self._left[unit.index] -= 1
        return unit if self._left[unit.index] == 0 else None

    def reset(self):
        self._left = {}
