"""Chrome trace-event output: what each rank computed and communicated, and when.

One JSON file per rank (``trace_rank{r}.json``), loadable in chrome://tracing or Perfetto.
Thread "compute" holds forward/backward per layer and the optimizer step; thread "comm"
holds each collective as the communication thread actually ran it (from the work handle's
start and finish times), so DDP's bucket all-reduces are seen overlapping backward.
"""
import json
import os
import time
from contextlib import contextmanager

COMPUTE, COMM = 0, 1


class Tracer:
    def __init__(self, rank, enabled):
        self.rank, self.enabled = rank, enabled
        self.events = []
        self._t0 = time.perf_counter()

    def _us(self, t):
        return (t - self._t0) * 1e6

    @contextmanager
    def span(self, name, **args):
        """Record the enclosed compute as one event."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, COMPUTE, start, time.perf_counter(), args)

    def comm(self, name, work, **args):
        """Record a finished collective from its work handle's own timestamps."""
        if self.enabled and work.started is not None and work.finished is not None:
            self._add(name, COMM, work.started, work.finished, args)

    def _add(self, name, tid, start, end, args):
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": tid,
                            "ts": self._us(start), "dur": (end - start) * 1e6, "args": args})

    def write(self, directory):
        if not self.enabled:
            return None
        os.makedirs(directory, exist_ok=True)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
                 for tid, name in ((COMPUTE, "compute"), (COMM, "comm"))]
        path = os.path.join(directory, f"trace_rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
        return path
