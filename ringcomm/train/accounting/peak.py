"""Peak memory of a training step as the allocator sees it.

Python's ``tracemalloc`` records every allocation numpy makes for array data, so the peak
traced during a step, above what was live when it began, is everything the step allocated
and held at its worst moment: saved activations, gradient contributions, transient
gradient and gather buffers of the strategy, communication copies. Model state allocated
before the step (parameters, optimizer state, persistent gradient buffers) is in the
baseline; :func:`allocated_by` measures it the same way when the strategy allocates it, beside
what :class:`.memory.MemoryRegistry` records by category.

Tracing every allocation slows the step it watches by a few per cent, so by default only
some steps are watched (``sampled``): the first ``SAMPLED_FIRST`` of a run and then one in
``SAMPLED_EVERY``. Every step of a run allocates alike (the same shapes, the same schedule),
so their peak is the same; ``every=True`` (``--memory-watch every``) watches each one.

>>> watch = PeakWatch()
>>> if watch.watches(i): watch.begin(); step(); watch.end()   # i: steps taken in this run
>>> watch.peak                                                 # bytes
"""
import tracemalloc

SAMPLED_FIRST, SAMPLED_EVERY = 3, 50  # a sampled watch: the run's first steps, then 1 in 50


class PeakWatch:
    """``enabled=False`` (device memory, which tracemalloc cannot see): ``peak`` stays −1,
    "not measured". ``every``: watch every step, not a sample of them."""

    def __init__(self, enabled=True, every=False):
        self.enabled, self.every = enabled, every
        self.peak = 0 if enabled else -1   # the largest step peak, bytes
        self.watched = 0  # steps watched so far
        self._mine = False

    def watches(self, i):
        """Whether to watch the step after ``i`` steps of this run."""
        return self.enabled and (self.every or i < SAMPLED_FIRST or i % SAMPLED_EVERY == 0)

    def begin(self):
        """Start watching a step: what is live now is the baseline, not counted."""
        if not self.enabled:
            return
        self._mine = not tracemalloc.is_tracing()
        if self._mine:
            tracemalloc.start(1)  # traces only what is allocated from here on
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]

    def end(self):
        if not self.enabled:
            return
        peak = tracemalloc.get_traced_memory()[1]
        self.peak = max(self.peak, peak - self._base)
        self.watched += 1
        if self._mine:
            tracemalloc.stop()


def allocated_by(fn, *args):
    """``(fn(*args), bytes)``: the bytes ``fn`` allocated that are still alive when it
    returns, as ``tracemalloc`` saw them (host memory only: numpy, pinned buffers)."""
    mine = not tracemalloc.is_tracing()
    if mine:
        tracemalloc.start(1)
    before = tracemalloc.get_traced_memory()[0]
    try:
        result = fn(*args)
        return result, tracemalloc.get_traced_memory()[0] - before
    finally:
        if mine:
            tracemalloc.stop()
