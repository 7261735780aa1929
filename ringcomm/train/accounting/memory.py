"""Model-state memory per rank under data parallelism and ZeRO: formulas, a measuring
registry, and the table of the ZeRO paper.

Notation: Φ parameters, N ranks, p / g bytes per parameter and per gradient element in
forward/backward (2 and 2 in fp16 mixed precision), K bytes of optimizer state per parameter
(12 for mixed-precision Adam: fp32 master, momentum, variance).

=========  =====================  ===============================
strategy   formula (bytes/rank)   what is sharded
=========  =====================  ===============================
ddp        (p + g + K)Φ           nothing
zero1      (p + g)Φ + KΦ/N        optimizer state
zero2      pΦ + (g + K)Φ/N        + gradients
zero3      (p + g + K)Φ/N         + parameters
dp         rank 0 as ddp,         (parameter server: only rank 0
           others (p + g)Φ        keeps optimizer state)
=========  =====================  ===============================

With ``offload`` the optimizer state lives in host memory instead (category
``optimizer_host``), so it leaves the device total; offloaded from a GPU, the host also
keeps the fp32 master and the *host shard* (p bytes per parameter of the shard) through
which gradients come down and parameters go up.

    python -m ringcomm.memory --params 7.5e9 --world-size 64 --k 12
    # ddp 120.0 GB, zero1 31.4 GB, zero2 16.6 GB, zero3 1.9 GB   (ZeRO paper, Figure 1)
"""
import argparse
from collections import defaultdict

import numpy as np

STRATEGIES = ("single", "dp", "ddp", "zero1", "zero2", "zero3")
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}  # the strategies that are ZeRO, by stage
CATEGORIES = ("params", "grads", "optimizer", "optimizer_host")


def predicted(strategy, phi, n, p=2, g=2, k=12, rank=0, offload=False):
    """Bytes of model state per category on ``rank`` for ``strategy`` (formulas above)."""
    stage = ZERO_STAGES.get(strategy, 0)
    params = p * phi / n if stage >= 3 else p * phi
    grads = g * phi / n if stage >= 2 else g * phi
    optimizer = k * phi / n if stage >= 1 else k * phi
    if strategy == "dp" and rank != 0:
        optimizer = 0.0  # the parameter server: only rank 0 keeps optimizer state
    out = {"params": params, "grads": grads, "optimizer": 0.0, "optimizer_host": 0.0}
    out["optimizer_host" if offload else "optimizer"] = optimizer
    return out


def optimizer_bytes(master, state_bytes):
    """K: optimizer bytes per parameter, the fp32 master copy (when there is one, 4 bytes)
    and the optimizer's own state."""
    return (4 if master else 0) + state_bytes


def strategy_bytes(strategy, phi, n, e, k, rank=0, offload=False, host_shard=False):
    """:func:`predicted` for a strategy storing parameters and gradients in ``e`` bytes,
    with ``host_shard`` (offloaded from a GPU) the host shard too: e bytes per parameter of
    the shard, in ``optimizer_host``."""
    out = predicted(strategy, phi, n, e, e, k, rank=rank, offload=offload)
    if host_shard:
        out["optimizer_host"] += e * phi / n
    return out


def device_total(categories):
    return sum(v for c, v in categories.items() if c != "optimizer_host")


def _pinned_zeros(shape, dtype):
    """A zeroed numpy array in page-locked host memory (for offloaded optimizer state)."""
    import cupyx
    return cupyx.zeros_pinned(shape, dtype)


class MemoryRegistry:
    """Allocates and records every model-state buffer by category, with peaks.

    >>> reg = MemoryRegistry()
    >>> w = reg.alloc("params", "W0", (4, 4), np.float16)    # 32 bytes of params
    >>> reg.free("W0"); reg.current()["params"], reg.peak_total()
    (0, 32)
    """

    def __init__(self, xp=np):
        self.xp = xp
        self._live = {}  # name -> (category, nbytes)
        self._current = defaultdict(int)
        self._peak = defaultdict(int)
        self._peak_total = 0

    def alloc(self, category, name, shape, dtype, xp=None, zeroed=True):
        """A zeroed array (``zeroed=False``: uninitialised, for a buffer the caller fills
        whole) recorded under ``category``; ``name`` must be unique while live."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}")
        if name in self._live:
            raise ValueError(f"buffer {name!r} is already allocated")
        if xp is None and category == "optimizer_host" and self.xp is not np:
            array = _pinned_zeros(shape, dtype)  # host memory the GPU copies fast
        else:
            array = ((xp or self.xp).zeros if zeroed else (xp or self.xp).empty)(shape, dtype)
        self._live[name] = (category, array.nbytes)
        self._current[category] += array.nbytes
        self._peak[category] = max(self._peak[category], self._current[category])
        self._peak_total = max(self._peak_total, device_total(self._current))
        return array

    def free(self, name):
        category, nbytes = self._live.pop(name)
        self._current[category] -= nbytes

    def current(self):
        return {c: self._current[c] for c in CATEGORIES}

    def peak(self):
        return {c: self._peak[c] for c in CATEGORIES}

    def peak_total(self):
        """The highest device model-state total seen at any moment."""
        return self._peak_total


def table(phi, n, p=2, g=2, k=12):
    """Rows (strategy, params, grads, optimizer, total) in bytes, for the CLI and reports."""
    rows = []
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        cat = predicted(strategy, phi, n, p, g, k)
        rows.append((strategy, cat["params"], cat["grads"], cat["optimizer"], device_total(cat)))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ringcomm.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, required=True, help="number of parameters Φ (e.g. 7.5e9)")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks N")
    parser.add_argument("--k", type=float, default=12, help="optimizer bytes per parameter (default 12)")
    parser.add_argument("--param-bytes", type=float, default=2, help="bytes per parameter (default 2, fp16)")
    parser.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient (default 2, fp16)")
    args = parser.parse_args(argv)
    if args.params <= 0 or args.world_size < 1:
        parser.error("--params must be positive and --world-size at least 1")
    print(f"model-state memory per device: Φ = {args.params:.4g} parameters, N = {args.world_size}, "
          f"K = {args.k:g}, {args.param_bytes:g}-byte params, {args.grad_bytes:g}-byte grads")
    print(f"{'strategy':<10}{'params GB':>12}{'grads GB':>12}{'optimizer GB':>14}{'total GB':>12}")
    for name, prm, grd, opt, total in table(args.params, args.world_size, args.param_bytes, args.grad_bytes, args.k):
        print(f"{name:<10}{prm / 1e9:>12.1f}{grd / 1e9:>12.1f}{opt / 1e9:>14.1f}{total / 1e9:>12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
