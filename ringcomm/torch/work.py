"""The ``Work`` torch.distributed gets back from every verb, and the threads that complete
its futures.

A :class:`TorchWork` wraps one ringcomm :class:`~ringcomm.engine.Work` (or nothing, for a
call that already ran synchronously) and the :class:`~ringcomm.torch.tensors.Loan` to finish
when it completes. ``wait()`` waits for ringcomm, finishes the loans (copies back what was
copied) and raises ringcomm's error if the collective failed. ``get_future()`` returns a
``torch.futures.Future`` that a *completer* thread finishes: never ringcomm's communication
thread, because a future's callbacks run where it is completed, and DDP's communication
hooks start collectives there, and some (PowerSGD) wait for them inside the callback.

Completers: one thread, and another whenever every completer is inside a callback while
a completion waits, so a callback that waits for a later future (which only a completer
can finish) never deadlocks. Spare completers leave after a few idle seconds.

*Inline futures* (:func:`inline_futures`, or ``RINGCOMM_TORCH_INLINE_FUTURES=1``):
``get_future()`` blocks until the call finished and returns a completed future, so ``then``
callbacks run at once in the thread that asked (the order NCCL gets by completing CUDA
futures at enqueue, without blocking). A comm hook whose callbacks start collectives
(PowerSGD) then issues them in one order on every rank with any number of buckets; the
price is that those collectives no longer overlap the backward pass, and that a receive's
``get_future()`` waits for its message.

A future's failure is a C++ error (see :meth:`TorchWork.get_future`): waiting for it raises
``RuntimeError`` carrying ringcomm's error class and words; ``wait()`` raises ringcomm's
error itself.

>>> work = pg.allreduce([t], opts)     # what torch.distributed.all_reduce(t, async_op=True) returns
>>> work.get_future().then(callback)   # DDP's comm hooks
>>> work.wait()                        # t holds the sum, or ringcomm's error is raised
"""
import atexit
import logging
import os
import queue
import threading
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
SPARE_IDLE_S = 5.0  # a spare completer with nothing to do for this long leaves
MAX_COMPLETERS = 64  # past this, completions wait for a completer to come back


class Completer:
    """Runs ``fn()`` for each :meth:`put`, on completer threads (see the module docstring)."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = self._queued = 0

    def put(self, fn):
        with self._lock:
            self._queue.put(fn)
            self._queued += 1
            spawn = self._idle < self._queued and self._threads < MAX_COMPLETERS
            if spawn:
                self._threads += 1
                self._idle += 1
                primary = self._threads == 1
        if spawn:
            threading.Thread(target=self._loop, args=(primary,), daemon=True,
                             name="ringcomm-torch-completer").start()

    def _loop(self, primary):
        while True:
            try:
                fn = self._queue.get(timeout=None if primary else SPARE_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queued:  # something came just now: take it
                        continue
                    self._threads -= 1
                    self._idle -= 1
                    return
            with self._lock:
                self._queued -= 1
                self._idle -= 1
            try:
                fn()
            except BaseException:  # noqa: BLE001 - a completer outlives what it completes
                log.exception("completing a ringcomm future failed")
            finally:
                with self._lock:
                    self._idle += 1


    def settle(self, timeout):
        """Wait up to ``timeout`` seconds until no completer runs or awaits a completion."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queued and self._idle == self._threads:
                    return
            time.sleep(0.005)


COMPLETER = Completer()
# A daemon thread still inside torch's C++ (a future's callbacks) when the interpreter
# finalizes is unwound through frames that may not be, and the process aborts ("terminate
# called without an active exception"): at exit, let the completers finish first.
atexit.register(COMPLETER.settle, 5.0)
_inline = os.environ.get("RINGCOMM_TORCH_INLINE_FUTURES", "0") not in ("", "0")


def inline_futures(on=True):
    """Whether ``get_future()`` waits for its call and runs callbacks in the asking thread
    (see the module docstring); for every ringcomm group of this process. Returns the
    setting it replaces.

    >>> ringcomm.torch.inline_futures()      # before DDP with PowerSGD and several buckets
    """
    global _inline
    before, _inline = _inline, bool(on)
    return before


class TorchWork(dist._Work):
    """Handle of one verb: ``work`` is ringcomm's (None: already done), ``loans`` are
    finished once it completes, ``result`` is the future's value (the output tensors)."""

    def __init__(self, work, loans, result, after=None):
        super().__init__()
        self._work, self._loans, self._result, self._after = work, loans, result, after
        self._lock = threading.Lock()
        self._finished = work is None
        self._error = None
        self._future = None
        self.source = None  # a named receive's source (see _source_rank)
        if work is None:
            self._finish_loans()

    def _finish_loans(self):
        if self._after is not None:  # before the loans copy their arrays back
            self._after()
        for loan in self._loans:
            loan.finish()
        self._loans = ()

    def _settle(self, timeout=None):
        """Wait for ringcomm (its ``CommTimeout`` if ``timeout`` runs out first: the call
        goes on), then finish the loans once; the call's error, or None."""
        if self._work is not None:
            try:
                # synchronize: the loans' copies back and the user's kernels run on torch's
                # streams, which ringcomm's stream order (CuPy's current stream) does not
                # reach; blocking the host until the device work is done orders them all
                self._work.wait(timeout, synchronize=True)
            except BaseException:
                if not self._work.is_completed():
                    raise
        with self._lock:
            if not self._finished:
                try:
                    self._error = self._work.exception()
                    if self._error is None:
                        self._finish_loans()
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    self._error = exc
                finally:  # read without the lock by is_completed: set once the copies are done
                    self._finished = True
        return self._error

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        error = self._settle(seconds or None)  # torch passes 0 for "no timeout"
        if error is not None:
            raise error
        return True

    def is_completed(self):
        """True once the call ended and its outputs hold their data (copies included; on a
        GPU the device work has run)."""
        if self._finished:
            return True
        if not self._work.is_completed():
            return False
        self._settle()
        return True

    def is_success(self):
        return self.is_completed() and self.exception() is None

    def exception(self):
        if self._error is None and self._work is not None:
            return self._work.exception()
        return self._error

    def result(self):
        return self._result

    def _source_rank(self):
        """The group rank a receive took its message from, once it completed (it waits): the
        rank a named receive named, or the one a receive from any source
        (``pg.recv_anysource``) took from; ``dist.recv(t)`` without ``src`` returns it as a
        global rank.

        >>> work = dist.irecv(t)             # rank 0 of 3; rank 2 sent first
        >>> work.wait(); work._source_rank()  # 2
        """
        self.wait()
        if self.source is not None:  # a named receive: the rank it named
            return self.source
        source = None if self._work is None else self._work.wait()
        if type(source) is not int:
            raise RuntimeError("ringcomm: only a receive has a source rank")
        return source

    source_rank = _source_rank

    def get_future(self):
        """The future of this call: its value is the output tensors; on failure, waiting
        for it raises RuntimeError carrying ringcomm's error (its class and its words).

        torch's ``Future.set_exception`` stores the exception as the future's *value*,
        which only Python unwraps: DDP's C++ reducer would read it as the result and crash.
        An error raised inside a ``then`` callback is stored as a C++ error instead, which
        every caller (C++ and Python) sees as one; so the future handed out is the
        continuation of a private one that is completed with nothing."""
        with self._lock:
            if self._future is not None:
                return self._future
            settled = torch.futures.Future()
            self._future = future = settled.then(self._outcome)
        if self._work is None:
            settled.set_result(None)
        elif _inline:  # completed here and now: callbacks attached later run in this thread
            self._complete(settled)
        else:
            self._work.add_done_callback(lambda _: COMPLETER.put(lambda: self._complete(settled)))
        return future

    def _complete(self, settled):
        try:
            self._settle()
        finally:  # whatever happened, the future completes (its callbacks see the outcome)
            settled.set_result(None)

    def _outcome(self, _settled):
        if self._error is not None:
            raise self._error
        if not self._finished:  # the wait for it was interrupted: its outputs are not ready
            raise RuntimeError("ringcomm: the wait for this call was interrupted before it completed")
        return self._result


class AllOf:
    """The ringcomm-Work face of several TorchWorks (a coalesced call, a sparse all-reduce's
    two all-gathers): done when all are, failed with the first one's error."""

    def __init__(self, works):
        self._works = works

    def wait(self, timeout=None, synchronize=False):
        for w in self._works:  # a TorchWork's wait already waits for the device work
            w.wait(timeout)

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def exception(self):
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def add_done_callback(self, fn):
        self._works[-1]._work.add_done_callback(lambda _: fn(self))
