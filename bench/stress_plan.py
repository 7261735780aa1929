"""The deterministic plan of the stress job (bench/stress.py): what every rank runs, in order,
and what each call's result must be.

Every rank builds the same :class:`Plan` from the seed and draws the same steps from it, so
the ranks agree on the order of every collective on every communicator without talking about
it. A step is one synchronous call, a queue of up to 64 ``async_op`` calls waited together
(collectives on any communicator and p2p messages), a round of send/recv pairs (blocking or
not), a queue of rooted calls whose root comes late, a run of calls that mismatch on purpose
(every rank must raise CollectiveMismatch; the ranks that fail fast run far ahead of a late
one, the one honest way to fill the collective window), a few torch.distributed verbs, or the
creation of a sub-group (with every rank, or by its members alone).
Each call's inputs are a function of (seed, call id, group rank) alone (:func:`data`), so any
rank can compute any other rank's input, and :func:`expected` computes the result with numpy.

Reduction inputs are small integers (or full-range integers, which wrap identically in any
order), so the result does not depend on the order of reduction and is compared bit for
bit; data-movement verbs carry random bytes (NaN payloads included) and are compared bit
for bit too.

>>> plan = Plan(seed=1, n=4, max_bytes=1 << 20)
>>> step = next(plan.steps())     # Step(kind="sync", items=[Item(verb="all_reduce", ...)])
"""
import random
from dataclasses import dataclass, field

import numpy as np

# every algorithm each verb accepts (ringcomm/algorithms/*.py __all__; "hier" on one host runs
# the flat ring, but it is still a separate choice that must be accepted and give the result)
ALGORITHMS = {
    "all_reduce": ("auto", "ring", "ps", "rd", "hier"),
    "reduce_scatter": ("auto", "ring", "ps", "hier"),
    "all_gather": ("auto", "ring", "ps", "hier"),
    "broadcast": ("auto", "ring", "ps", "hier"),
    "reduce": ("auto", "ring", "ps", "hier"),
    "gather": ("auto", "ps"),       # straight to the root
    "scatter": ("auto", "ps"),      # straight from the root
    "all_to_all": ("auto", "ring"),  # pairwise exchanges, equal or uneven splits
    "barrier": ("auto", "ring", "ps", "rd"),
}
VERB_WEIGHTS = {"all_reduce": 5, "reduce_scatter": 2, "all_gather": 2, "broadcast": 2, "reduce": 2,
                "gather": 2, "scatter": 2, "all_to_all": 3, "barrier": 1}
DTYPES = ("float32", "float64", "float16", "int32", "int64", "int8", "uint8", "bool")
FLOAT_OPS = ("sum", "avg", "max", "min", "prod")
INT_OPS = ("sum", "max", "min", "prod", "band", "bor", "bxor")
P2P_TAGS = (0, 1, 5)
BATCH_MAX = 64        # async calls in flight at once
BATCH_MAX_BYTES = 8 << 20  # what one queue's buffers may hold, all calls together
UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


@dataclass(frozen=True)
class Item:
    """One call. ``comm``: 0 the world, i > 0 the i-th group made so far (see Step "group").
    ``m``: elements per rank (the verb's per-rank part: reduce_scatter's ``out``, all_gather's
    ``x``, gather's ``x``, scatter's ``out``; all_reduce's, broadcast's and reduce's ``x``).
    ``splits``: all_to_all's matrix (splits[r][s]: elements group rank r sends to s), or None
    for equal blocks of ``m``. ``pairs``: a p2p item's (src, dst, tag) in group ranks."""
    id: int
    verb: str
    comm: int
    alg: str = "auto"
    dtype: str = "float32"
    m: int = 0
    op: str = "sum"
    root: int = 0
    splits: tuple = None
    in_place: bool = False
    none_elsewhere: bool = False  # gather's out / scatter's x passed as None off the root
    shape2d: bool = False         # all_reduce / broadcast of a (2, m/2) array
    src: int = 0                  # send/recv: group ranks
    dst: int = 0
    tag: int = 0
    odd: int = -1                 # mismatch: the group rank that passes twice the elements


@dataclass
class Step:
    kind: str                     # sync | batch | p2p | torch | group | mismatch | agree
    items: list = field(default_factory=list)
    reverse_wait: bool = False    # batch: wait for the works last-submitted first
    blocking: bool = True         # p2p: blocking sends, then blocking recvs
    members: tuple = ()           # group: the members, in group-rank order
    members_only: bool = False
    time_is_up: int = 0           # agree: this rank's own vote (set by the worker)
    late: tuple = ()              # batch: (group rank, seconds) that sleeps before it starts


class Plan:
    """The infinite sequence of steps for ``n`` ranks; every rank draws the same one.
    ``torch``: include torch.distributed steps (:mod:`stress_torch` runs them)."""

    def __init__(self, seed, n, max_bytes=1 << 20, torch=False, max_groups=8):
        self.seed, self.n, self.max_bytes, self.torch = seed, n, max_bytes, torch
        self.max_groups = max_groups
        self.rng = random.Random(seed)
        self.groups = [tuple(range(n))]  # comm index -> members (0: the world)
        self.next_id = 0

    # -- sizes, dtypes, groups ------------------------------------------------------------
    def nbytes(self):
        """A buffer size: mostly tiny, some up to the channel/lane boundary (256 KiB), a few
        up to ``max_bytes``, and now and then exactly 0."""
        r, top = self.rng.random(), self.max_bytes
        if r < 0.05:
            return 0
        if r < 0.70:
            return self.rng.randint(1, min(256, top))
        if r < 0.92:
            return self.rng.randint(1, min(16 << 10, top))
        if r < 0.985:
            return self.rng.randint(1, min(256 << 10, top))
        return self.rng.randint(1, top)

    def new_members(self):
        """A random subset of 2..n ranks (n: the whole world in another order), or one rank on a
        world of 2."""
        size = self.rng.randint(2 if self.n > 2 else 1, self.n)
        members = self.rng.sample(range(self.n), size)
        if size < self.n and self.rng.random() < 0.5:
            members.sort()
        return tuple(members)

    def _id(self):
        self.next_id += 1
        return self.next_id - 1

    # -- items ----------------------------------------------------------------------------
    def collective(self, comm=None, verb=None):
        rng = self.rng
        if comm is None:  # world 60%, else one of the groups
            comm = 0 if len(self.groups) == 1 or rng.random() < 0.6 else rng.randrange(1, len(self.groups))
        g = len(self.groups[comm])
        verb = verb or rng.choices(list(VERB_WEIGHTS), list(VERB_WEIGHTS.values()))[0]
        dtype = rng.choice(DTYPES)
        itemsize = np.dtype(dtype).itemsize
        count = self.nbytes() // itemsize
        ops = FLOAT_OPS if dtype.startswith("float") else INT_OPS
        kw = dict(id=self._id(), verb=verb, comm=comm, alg=rng.choice(ALGORITHMS[verb]), dtype=dtype,
                  op=rng.choice(ops), root=rng.randrange(g))
        if verb in ("all_reduce", "broadcast", "reduce"):
            kw["m"] = count
            kw["shape2d"] = count % 2 == 0 and count > 0 and rng.random() < 0.2
        elif verb in ("reduce_scatter", "all_gather", "gather", "scatter"):
            kw["m"] = count // g
            kw["in_place"] = verb in ("reduce_scatter", "all_gather") and rng.random() < 0.2
            kw["none_elsewhere"] = rng.random() < 0.5
        elif verb == "all_to_all":
            if rng.random() < 0.5:
                kw["m"] = count // g  # equal blocks of m
            else:                     # uneven: each pair its own size, zeros included
                per = max(1, count // (g * g))
                kw["splits"] = tuple(tuple(0 if rng.random() < 0.15 else rng.randint(0, 2 * per)
                                           for _ in range(g)) for _ in range(g))
        return Item(**kw)

    def p2p(self, comm):
        """One message between two distinct group ranks (a 1-rank group has none: None)."""
        g = len(self.groups[comm])
        if g < 2:
            return None
        src, dst = self.rng.sample(range(g), 2)
        dtype = self.rng.choice(DTYPES)
        return Item(id=self._id(), verb="p2p", comm=comm, dtype=dtype,
                    m=self.nbytes() // np.dtype(dtype).itemsize, src=src, dst=dst,
                    tag=self.rng.choice(P2P_TAGS))

    # -- steps ----------------------------------------------------------------------------
    def initial_groups(self):
        """The groups made before the stress starts: two with every rank, one members-only."""
        steps = []
        for members_only in (False, False, True):
            steps.append(self.group_step(members_only))
        return steps

    def group_step(self, members_only=None):
        if members_only is None:
            members_only = self.rng.random() < 0.5
        members = self.new_members()
        self.groups.append(members)
        return Step("group", members=members, members_only=members_only)

    def steps(self):
        """The plan, step after step, forever (the worker decides where it ends)."""
        rng = self.rng
        while True:
            r = rng.random()
            if self.torch and r < 0.06:
                yield Step("torch", items=[self.torch_item() for _ in range(rng.randint(1, 4))])
            elif r < 0.08 and len(self.groups) < self.max_groups:
                yield self.group_step()
            elif r < 0.11:
                yield self.late_root()
            elif r < 0.13:
                yield self.mismatch()
            elif r < 0.55:
                yield Step("sync", items=[self.collective()])
            elif r < 0.70:
                comm = 0 if rng.random() < 0.6 else rng.randrange(len(self.groups))
                items = [i for i in (self.p2p(comm) for _ in range(rng.randint(1, 8))) if i]
                yield Step("p2p", items=items, blocking=rng.random() < 0.5)
            else:
                yield self.batch()

    def batch(self):
        """Up to 64 async calls: collectives on any communicator, and p2p messages."""
        rng = self.rng
        k = BATCH_MAX if rng.random() < 0.15 else min(BATCH_MAX, int(2 ** rng.uniform(0, 6)))
        items, held = [], 0
        while len(items) < k:
            item = self.p2p(rng.randrange(len(self.groups))) if rng.random() < 0.15 else self.collective()
            if item is None:
                continue
            held += buffer_bytes(item, len(self.groups[item.comm]))
            if held > BATCH_MAX_BYTES and items:
                break
            items.append(item)
        return Step("batch", items=items, reverse_wait=rng.random() < 0.3)

    def late_root(self):
        """A queue of rooted calls (gather; reduce through the parameter server) whose root
        comes late, as a descheduled rank would: the others' queues wait for it (a rooted
        call first exchanges signatures with every rank, so none finishes without it)."""
        rng = self.rng
        comm = 0 if rng.random() < 0.6 else rng.randrange(len(self.groups))
        g = len(self.groups[comm])
        root = rng.randrange(g)
        items = []
        for _ in range(rng.randint(20, BATCH_MAX)):
            verb = rng.choice(("gather", "reduce"))
            dtype = rng.choice(("float32", "int64", "uint8"))
            m = rng.randint(0, 4096 // np.dtype(dtype).itemsize) // (g if verb == "gather" else 1)
            items.append(Item(id=self._id(), verb=verb, comm=comm, alg="ps", dtype=dtype, m=m,
                              op=rng.choice(("sum", "max")), root=root, none_elsewhere=rng.random() < 0.5))
        return Step("batch", items=items, reverse_wait=rng.random() < 0.3, late=(root, 0.1))

    def mismatch(self):
        """Calls that fail on purpose: one rank passes twice the elements, so every rank must
        raise CollectiveMismatch, and those that fail fast run ahead of a rank that comes
        late: honest run-ahead, which backpressure (not refusal) must absorb. Then the job
        goes on as before."""
        rng = self.rng
        comms = [c for c in range(len(self.groups)) if len(self.groups[c]) >= 3] or [0]
        comm = rng.choice(comms)
        g = len(self.groups[comm])
        odd, late = rng.sample(range(g), 2) if g >= 2 else (0, 0)
        items = [Item(id=self._id(), verb="mismatch", comm=comm, alg=rng.choice(("ring", "rd", "ps")),
                      dtype="float32", m=4, odd=odd) for _ in range(rng.randint(4, 48))]  # up to 3 windows
        return Step("mismatch", items=items, late=(late, 0.3))

    def agree_step(self):
        """``--seconds`` runs: every rank says whether its time is up (an all-reduce max)."""
        return Step("agree", items=[Item(id=self._id(), verb="agree", comm=0, dtype="int32", m=1, op="max")])

    def torch_item(self):
        """A torch.distributed verb on the world or the torch sub-group (comm -1), small."""
        rng = self.rng
        verb = rng.choice(("all_reduce", "all_reduce_async", "broadcast", "reduce", "all_gather_into_tensor",
                           "all_gather", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter",
                           "barrier", "send_recv", "batch_isend_irecv"))
        comm = -1 if rng.random() < 0.3 else 0
        g = len(self.torch_group) if comm == -1 else self.n
        dtype = rng.choice(("float32", "float64", "float16", "int32", "int64"))
        m = rng.randint(0, 4096 // np.dtype(dtype).itemsize)
        ops = ("sum", "max", "min", "prod") + (("avg",) if dtype.startswith("float") else ("band", "bor", "bxor"))
        kw = dict(id=self._id(), verb=verb, comm=comm, dtype=dtype, m=m, op=rng.choice(ops),
                  root=rng.randrange(g))
        if verb == "all_to_all_single":
            kw["splits"] = tuple(tuple(rng.randint(0, 6) for _ in range(g)) for _ in range(g))
        if verb in ("send_recv", "batch_isend_irecv"):
            if g < 2:
                return Item(id=kw["id"], verb="barrier", comm=comm)
            kw["src"], kw["dst"] = rng.sample(range(g), 2)
            kw["tag"] = rng.choice(P2P_TAGS)
        return Item(**kw)

    @property
    def torch_group(self):
        """The members of the one torch sub-group (drawn from the seed, not from the stream)."""
        members = random.Random(self.seed + 1).sample(range(self.n), max(1, self.n - 1))
        return tuple(sorted(members))


# -- inputs and results ---------------------------------------------------------------------
def data(seed, item, rank, count, kind="reduce"):
    """Group rank ``rank``'s input of ``item``: ``count`` elements. ``kind`` "reduce": values
    whose reduction is exact in any order (small integers for floats, any integers for
    integer dtypes, which wrap alike in any order); "move": random bytes (floats: any bit
    pattern, NaNs too); "garbage": what an output holds before the call."""
    dtype = np.dtype(item.dtype)
    rng = np.random.default_rng([seed, item.id, rank, {"reduce": 0, "move": 1, "garbage": 2}[kind]])
    if dtype == np.bool_:
        return rng.integers(0, 2, count, dtype=np.uint8).astype(bool)
    if kind == "reduce" and dtype.kind == "f":
        lo, hi = (-2, 3) if item.op == "prod" else (-64, 65)
        return rng.integers(lo, hi, count).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    return np.frombuffer(rng.bytes(count * dtype.itemsize), dtype).copy()


def reduce_all(op, arrays):
    """``op`` over ``arrays`` in order, as numpy computes it (avg: the sum divided once)."""
    acc = arrays[0].copy()
    for a in arrays[1:]:
        UFUNC[op](acc, a, out=acc)
    if op == "avg" and acc.size:
        np.true_divide(acc, len(arrays), out=acc)
    return acc


def kind_of(verb):
    return "reduce" if verb in ("all_reduce", "reduce_scatter", "reduce") else "move"


def sizes(item, g):
    """(elements of this verb's input x, of its output out) on group rank r, per rank r."""
    v, m = item.verb, item.m
    if v in ("all_reduce", "broadcast", "reduce", "agree"):
        return [(m, m)] * g
    if v == "reduce_scatter":
        return [(g * m, m)] * g
    if v in ("all_gather", "gather"):
        return [(m, g * m)] * g
    if v == "scatter":
        return [(g * m, m)] * g
    if v == "all_to_all":
        if item.splits is None:
            return [(g * m, g * m)] * g
        return [(sum(item.splits[r]), sum(item.splits[s][r] for s in range(g))) for r in range(g)]
    if v == "p2p":
        return [(m, m)] * g
    return [(0, 0)] * g  # barrier


def buffer_bytes(item, g):
    """Bytes of the buffers one rank holds for ``item`` (input and output, the larger rank)."""
    return max(i + o for i, o in sizes(item, g)) * np.dtype(item.dtype).itemsize


def peer_bytes(item, g):
    """An upper bound on what one peer sends one rank in ``item`` (README's B_max): a ring
    all-reduce moves 2(g−1)/g of the buffer from the left neighbour, parameter-server
    all-gather the whole ``out``; twice the largest buffer covers every schedule."""
    return 2 * max(max(i, o) for i, o in sizes(item, g)) * np.dtype(item.dtype).itemsize


def expected(seed, item, g, r):
    """{name: array} that group rank ``r`` of a ``g``-rank group must hold after ``item``:
    "out" (or "x" where the verb writes x), and "x" unchanged where the verb must not write it."""
    v, m, k = item.verb, item.m, kind_of(item.verb)
    n_in = sizes(item, g)

    def inp(s):
        return data(seed, item, s, n_in[s][0], k)

    def every():
        return [inp(s) for s in range(g)]
    if v == "all_reduce":
        return {"x": reduce_all(item.op, every())}
    if v == "reduce_scatter":
        out = reduce_all(item.op, every())[r * m:(r + 1) * m]
        return {"out": out} if item.in_place else {"out": out, "x": inp(r)}
    if v == "all_gather":
        return {"out": np.concatenate(every())}
    if v == "broadcast":
        return {"x": inp(item.root)}
    if v == "reduce":
        return {"x": reduce_all(item.op, every()) if r == item.root else inp(r)}
    if v == "gather":
        return {"out": np.concatenate(every())} if r == item.root else {}
    if v == "scatter":
        return {"out": inp(item.root)[r * m:(r + 1) * m]}
    if v == "all_to_all":
        splits = item.splits or tuple((m,) * g for _ in range(g))
        blocks = []
        for s in range(g):
            at = sum(splits[s][:r])
            blocks.append(inp(s)[at:at + splits[s][r]])
        return {"out": np.concatenate(blocks), "x": inp(r)}
    return {}


def same_bits(a, b):
    return a.dtype == b.dtype and a.size == b.size and np.array_equal(
        np.ascontiguousarray(a).reshape(-1).view(np.uint8), np.ascontiguousarray(b).reshape(-1).view(np.uint8))
