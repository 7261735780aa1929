"""The communication thread, and the work handles that ``async_op=True`` returns.

ZeroMQ sockets are not thread-safe, so one thread per process owns the session (and its
wire) and runs every collective, in submission order, from a queue; a synchronous
collective submitted while the thread is idle runs in the caller's thread instead, holding
the session (:meth:`Engine.hold`). A synchronous call otherwise submits and waits; an asynchronous call
returns the :class:`Work` at once. numpy and pyzmq release the GIL in
their heavy loops, so the caller's compute overlaps the communication.

>>> work = comm.all_reduce(grad, async_op=True)   # returns at once
>>> loss = forward(next_batch)                     # overlaps with the all-reduce
>>> work.wait()                                    # grad now holds the sum
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .errors import CommError, CommTimeout

log = logging.getLogger(__name__)
_DONE_LOCK = threading.Lock()  # orders Work._finish against a waiter making its Event
_waiting = 0  # threads of this process blocked in Work.wait (under _DONE_LOCK)


_engines = weakref.WeakSet()  # every engine of this process (see _after_fork)


def _after_fork():
    """In a forked child: no lock may stay held by a thread that does not exist there, and
    the parent's engines are closed (their thread is not in the child: work queued for it
    would wait forever), so every call on them raises at once."""
    global _DONE_LOCK, _waiting
    _DONE_LOCK, _waiting = threading.Lock(), 0  # (the parent's waiting threads are not here)
    for engine in list(_engines):
        engine.lock, engine._busy = threading.Lock(), threading.Lock()
        engine.closed = engine.forked = True


os.register_at_fork(after_in_child=_after_fork)


class Deferred:
    """An operation that waits for messages without holding the communication thread.

    Returned by a work function that would otherwise block (a point-to-point receive); the
    engine calls ``progress()`` between other work and while idle until it returns True.
    Without this, ``recv(async_op=True)`` posted before a matching ``send`` would deadlock.
    """

    def __init__(self, progress, result=None):
        self.progress, self.result = progress, result


class Work:
    """Handle of one submitted operation."""

    def __init__(self, fn, what):
        self._fn, self.what = fn, what
        self._done = False  # the outcome is in (see _finish)
        self._settled = False  # ... and the done-callbacks have run
        self._event = None  # made only when someone waits before the work is done
        self._result = self._error = None
        self.started = self.finished = None  # time.perf_counter() on the communication thread
        self.inline = False  # run by the submitting thread (see Engine.submit)
        self._deferred = None  # set when the work waits for messages (see Deferred)
        self._callbacks = None  # see add_done_callback
        self._join = None  # see joins
        self._pid = os.getpid()  # a child forked after this was made has no thread to finish it

    def _run(self, session):
        """Run the work function; False if it deferred its completion (also when it was
        started inline and handed to the communication thread to finish)."""
        if self._deferred is not None:
            return False
        self.started = time.perf_counter()
        try:
            outcome = self._fn(session)
            if isinstance(outcome, Deferred):
                self._deferred = outcome
                return False
            self._result = outcome
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        self._fn = None
        self.finished = time.perf_counter()
        self._finish()
        return True

    def _advance(self):
        """Progress a deferred operation; True once it is finished."""
        try:
            if not self._deferred.progress():
                return False
            self._result = self._deferred.result
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
        self._fn = self._deferred = None
        self.finished = time.perf_counter()
        self._finish()
        return True

    def _finish(self):
        # done (is_completed) first, then the done-callbacks, then the waiters released: a
        # waiter who returns knows the callbacks ran; a synchronous call run inline is done
        # before anyone waits: no Event to make
        with _DONE_LOCK:
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
        try:
            for fn in callbacks or ():
                try:
                    fn(self)
                except Exception:  # noqa: BLE001 - the work itself is done; its waiters go on
                    log.exception("a done-callback of %s failed", self.what)
        finally:  # whatever a callback did, the waiters are released
            with _DONE_LOCK:
                self._settled = True
                event = self._event
            if event is not None:
                event.set()

    def add_done_callback(self, fn: Callable[[Work], object]) -> None:
        """Call ``fn(work)`` once the work is done, successfully or not: at once if it is,
        else on the thread that finishes it (mostly the communication thread, so ``fn``
        must be quick and must not wait for communication)."""
        with _DONE_LOCK:
            if not self._done:
                self._callbacks = [*(self._callbacks or ()), fn]
                return
        fn(self)

    def _fail(self, exc):
        self._error = exc
        self._finish()

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._done

    def wait(self, timeout: float | None = None, synchronize: bool = False) -> Any:
        """Block until done (at most ``timeout`` seconds); return the result or raise its error.

        The communicator's own deadline bounds every operation, so ``timeout=None`` never
        waits forever. On a GPU, "done" means the device work is queued: the calling thread's
        current stream is made to wait for it (kernels queued next see the result; the host
        does not block); ``synchronize=True`` (or :meth:`synchronize`) blocks until it ran.
        """
        if not self._settled and self._pid != os.getpid():
            raise CommError(f"{self.what}: this process was forked from the one that submitted "
                            f"it and cannot wait for it (only that process can)")
        if not self._settled:
            with _DONE_LOCK:
                if not self._settled and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not _wait(event, timeout):
                raise CommTimeout(f"{self.what}: still running after wait(timeout={timeout})")
        if self._error is not None:
            raise self._error
        if self._join is not None:
            self._join(synchronize)
        return self._result

    def exception(self) -> BaseException | None:
        return self._error

    def joins(self, join: Callable[[bool], object]) -> None:
        """``join(synchronize)`` runs on the thread that waits, after a successful wait: on a
        GPU it orders that thread's stream after the call's device work."""
        self._join = join

    def synchronize(self, timeout: float | None = None) -> Any:
        """:meth:`wait`, then block until the operation's device work is finished too (on a
        GPU: its completion event; elsewhere the same as ``wait``)."""
        return self.wait(timeout, synchronize=True)


def _wait(event, timeout):
    """``event.wait(timeout)``, counted in ``_waiting`` (see :meth:`Engine.eager`)."""
    global _waiting
    with _DONE_LOCK:
        _waiting += 1
    try:
        return event.wait(timeout)
    finally:
        with _DONE_LOCK:
            _waiting -= 1


_IDLE = object()
IDLE_PUMP_S = 0.1  # how often an idle communication thread moves arrived messages
INLINE_WAIT_S = 0.001  # how long a caller finishing its own receive sleeps between looks


class Engine:
    """Owns the session and the thread that runs every operation on it.

    ``make_session`` runs on the thread itself, so the sockets are created where they
    are used; its errors are raised by the constructor.
    """

    def __init__(self, make_session, name="ringcomm"):
        self._queue = queue.SimpleQueue()
        self.lock = threading.Lock()  # orders sequence numbers with queue order
        self._busy = threading.Lock()  # held by whichever thread is using the session
        self._pending = 0   # queued or running on the communication thread (under lock)
        self._deferred = 0  # deferred operations in progress on the communication thread
        self.session = None
        self.closed = False
        self._abandoned = None  # why work still queued fails instead of running (see close)
        self._draining = False  # closing with a grace: deferred work may finish in it
        self.forked = False  # this process is a child forked from the engine's owner
        _engines.add(self)
        ready = Work(lambda _: make_session(), "start-up")
        self._thread = threading.Thread(target=self._loop, args=(ready,), name=name, daemon=True)
        self._thread.start()
        self.session = ready.wait()
        self.session.wire.eager = self.eager  # the wire's waits spin or yield by it

    def eager(self):
        """Whether the thread now waiting on the session should spin before it sleeps: the
        caller's own thread (a synchronous call run inline), or the communication thread
        while some thread is blocked in :meth:`Work.wait`. The communication thread running
        asynchronous work that nobody waits for yet yields instead: its spin would take the
        core, and the GIL, from the compute it overlaps."""
        return _waiting > 0 or threading.get_ident() != self._thread.ident

    def _loop(self, ready):  # noqa: C901 - a hot path (the communication thread's loop, once per queued call): one body, no helper calls
        ready._run(None)
        if ready.exception() is not None:
            return
        # set here, not only by the constructor's thread: on a loaded machine that thread may
        # not run again before this one's first idle pump
        self.session = ready._result
        deferred = []
        closing = False  # close(grace=...) came while deferred work was in progress
        try:
            while True:
                if closing and not deferred:
                    break
                if deferred:
                    try:
                        work = self._queue.get_nowait()
                    except queue.Empty:
                        with self._busy:
                            self.session.pump(0.001)
                        work = _IDLE
                else:
                    try:
                        work = self._queue.get(timeout=IDLE_PUMP_S)
                    except queue.Empty:
                        self._idle_pump()
                        continue
                if work is None:
                    # a close with a grace lets deferred work (an async receive, a send
                    # short of window) finish in it; a plain close fails it now
                    if not (deferred and self._draining):
                        break
                    closing, work = True, _IDLE
                with self._busy:
                    if self._abandoned is not None:  # closing without waiting: fail, don't run
                        for w in [*deferred, *([] if work is _IDLE else [work])]:
                            w._fail(CommError(f"{w.what}: {self._abandoned}"))
                        deferred = []
                    elif work is not _IDLE and not work._run(self.session):
                        deferred.append(work)
                    deferred = [w for w in deferred if not w._advance()]
                    self._deferred = len(deferred)
                if work is not _IDLE:
                    with self.lock:
                        self._pending -= 1
        except BaseException as exc:  # noqa: BLE001 - never leave waiters hanging
            log.exception("the communication thread failed")
            with self.lock:
                self.closed = True
            failure = CommError(f"the communication thread failed: {exc!r}")
            while True:
                try:
                    work = self._queue.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    work._fail(failure)
            for work in deferred:
                work._fail(failure)
            deferred = []
        for work in deferred:
            work._fail(CommError(f"{work.what}: communicator closed before it completed"))
        try:
            with self._busy:  # a caller thread may still run a collective inline
                self.session.close()
        except Exception:  # noqa: BLE001 - nothing left to report to
            log.exception("error while closing the session")

    def _idle_pump(self):
        """Move messages while no work runs, so that liveness checks get their answer; skipped
        when a caller thread holds the session (it moves messages itself)."""
        if self._busy.acquire(blocking=False):
            try:
                self.session.pump(0)
            finally:
                self._busy.release()

    def submit(self, fn, what, inline=False):
        """Queue ``fn(session)``; returns its :class:`Work`. Call with ``self.lock`` held.

        ``inline=True`` (a synchronous call): if the communication thread has nothing queued,
        running or deferred, the work is *not* queued; ``work.inline`` is set, this thread
        now holds the session (``_busy``), and the caller must call :meth:`run_inline`
        after releasing ``self.lock``. That saves the two thread hand-offs that dominate
        small collectives, keeps submission order (anything submitted meanwhile queues
        behind ``_busy``), and uses the sockets from one thread at a time under a lock (a
        full memory barrier, which is what ZeroMQ asks for when a socket changes threads).
        """
        work = Work(fn, what)
        if inline and self.hold():
            work.inline = True
            return work
        self._pending += 1
        self._queue.put(work)
        return work

    def hold(self):
        """Call with ``self.lock`` held: True if the communication thread has nothing queued,
        running or deferred and this thread now holds the session, to run one call that
        never defers (a collective) itself, then :meth:`release` it. No :class:`Work`, no
        hand-off (see :meth:`submit` for why this is safe)."""
        return self._pending == 0 and not self._deferred and self._busy.acquire(blocking=False)

    def release(self):
        self._busy.release()

    def run_inline(self, work):
        """Run a work item that :meth:`submit` kept for this thread; releases ``_busy``.

        A receive whose message has not come yet is finished here too, this thread moving
        messages itself, until another thread queues work: then the communication thread
        takes the receive over, so that the queued work (perhaps the send the peer needs
        before it answers) is not stuck behind it."""
        try:
            if work._run(self.session):
                return work
            # a receive (or a send short of credit) still waiting: this thread keeps moving
            # messages itself, saving two thread hand-offs, until another thread queues work,
            # which must not wait behind it (it may be what the peer needs to answer)
            try:
                while not self._pending and not self.closed:
                    if work._advance():
                        return work
                    self.session.pump(INLINE_WAIT_S)
            except BaseException:  # interrupted (KeyboardInterrupt): the thread finishes it
                self._hand_over(work)
                raise
            self._hand_over(work)
        finally:
            self._busy.release()
        return work

    def _hand_over(self, work):
        """Queue a started work for the communication thread, which only advances it."""
        if work._done:  # finished just before an interruption: nothing left to do
            return
        with self.lock:
            if self.closed:  # the thread is stopping: nobody would finish it
                work._fail(CommError(f"{work.what}: communicator closed before it completed"))
            else:
                self._pending += 1
                self._queue.put(work)  # _run sees it began: only _advance remains

    def close(self, timeout=60.0, grace=None):
        """Finish queued work, close the session (BYE to peers) and stop the thread.

        ``grace`` (seconds): queued and running work may take this long to finish; then
        whatever is left fails with :class:`CommError` (a wait in progress at once) and the
        thread stops within about a second more."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._draining = grace is not None
            self._queue.put(None)
        if grace is not None:
            try:
                self._thread.join(grace)
            finally:  # interrupted too: what is left must not wait for its own deadline
                if self._thread.is_alive():
                    self._abandoned = "the communicator was closed while this call was in flight"
                    self.session.stop(self._abandoned)
            timeout = max(0.0, timeout - grace)
        self._thread.join(timeout)
