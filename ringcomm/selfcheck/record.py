"""The record of the self-check's checks, kept in the same order on every rank so that the
ranks' verdicts can be merged by index (a check fails if it failed on any rank).

>>> checks = Checks(comm)
>>> checks.call(("all_reduce", "ring", label), comm.all_reduce, x, "sum", "ring")  # Fatal if it raises
>>> checks.add("all_reduce", "ring", label, compare(x, expected))  # None: passed here
"""
import sys
import traceback

MAX_PRINTED_FAILURES = 20


class Fatal(Exception):
    """A collective raised: the ranks may no longer agree on what runs next, so stop."""


class Checks:
    """Records checks in the same order on every rank, so they can be merged by index."""

    def __init__(self, comm):
        self.comm, self.rows, self.failed, self.names, self.printed = comm, {}, [], [], 0

    def add(self, collective, algorithm, label, error):
        index = len(self.failed)
        self.rows.setdefault((collective, algorithm), []).append(index)
        self.failed.append(False)
        self.names.append(f"{collective} algorithm={algorithm} {label}")
        if error:
            self.fail(index, error)
        return index

    def fail(self, index, error):
        self.failed[index] = True
        if self.printed < MAX_PRINTED_FAILURES:
            print(f"selfcheck: rank {self.comm.rank}: FAIL {self.names[index]}: {error}", file=sys.stderr, flush=True)
        elif self.printed == MAX_PRINTED_FAILURES:
            print(f"selfcheck: rank {self.comm.rank}: more failures not shown", file=sys.stderr)
        self.printed += 1

    def call(self, what, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not getattr(exc, "remote", False):  # this rank raised it first: show where
                traceback.print_exc()
            index = self.add(*what, f"raised {type(exc).__name__}: {exc}")
            raise Fatal(self.names[index]) from exc
