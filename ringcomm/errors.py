"""Exceptions raised by ringcomm.

Misuse that a rank can detect on its own (a wrong size, dtype, root, ...) raises the
built-in ``ValueError`` or ``TypeError`` before anything is sent. Everything that involves
other ranks raises a :class:`CommError`:

- :class:`CommTimeout`: a deadline passed; the message names the collective, its sequence
  number and the rank that was being waited on; when a liveness check found the rank that
  stopped answering (or one that never started the collective), ``.rank`` names it and
  ``.cause`` says which (``"silent"`` or ``"not started"``).
- :class:`PeerLost`: another rank died or closed its communicator; ``.rank`` names it.
- :class:`CollectiveMismatch`: ranks called different collectives, or the same collective
  with different arguments; the message describes both sides.
- :class:`Revoked`: the communicator was revoked: by two threads issuing collectives on it
  at once (its collectives fail, on every rank, from then on), or by ``comm.revoke()`` (every
  call on it fails).
- :class:`RanksLost`: a :class:`PeerLost` and a :class:`Revoked` at once: ranks of the
  communicator were lost and a survivor revoked it to shrink it (``comm.shrink()``); every
  call on it fails on every survivor, naming the lost ranks (``.rank``: the first).

An error that another rank reported for the same collective (through an abort message) has
``remote = True``; this rank does not forward it again. A report about a collective this rank
had already finished fails its next collective with a fresh error, which it does forward.
"""


class CommError(RuntimeError):
    """A collective could not complete because of other ranks or the network."""

    remote = False


TIMEOUT_CAUSES = (None, "silent", "not started")  # on the wire as their index


class CommTimeout(CommError, TimeoutError):
    """A wait passed its deadline; ``.rank``: the rank to blame, when one is known;
    ``.cause``: why, when a liveness check found out: ``"silent"`` (no reply: stopped, hung
    outside Python or unreachable) or ``"not started"`` (alive, never started the collective)."""

    def __init__(self, message, rank=None, cause=None):
        super().__init__(message)
        if cause not in TIMEOUT_CAUSES:
            raise ValueError(f"unknown timeout cause {cause!r}; expected one of {TIMEOUT_CAUSES}")
        self.rank, self.cause = rank, cause

    def after(self, seconds):
        """This timeout, its words ending with the deadline it passed ("... (the timeout is
        2 s)": the word torch's users and tests search an error for)."""
        return CommTimeout(f"{self} (the timeout is {seconds:g} s)", self.rank, self.cause)


class PeerLost(CommError):
    """A peer process died, disconnected or closed its communicator; ``.rank`` names it, or,
    when it closed because one of its calls failed on another rank, that rank (the one that
    failed first: see ringcomm.transport.goodbye)."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank


class CollectiveMismatch(CommError):
    """Ranks disagree on which collective runs, or on its dtype, size, op, root or algorithm."""


class Revoked(CommError):
    """The communicator was revoked on some rank: every pending and later collective on it
    (every call, after ``comm.revoke()``) fails on every rank, saying why (see
    :mod:`ringcomm.threads`, :mod:`ringcomm.elastic`)."""


class RanksLost(PeerLost, Revoked):
    """Ranks of the communicator were lost, and a survivor revoked it to shrink it: every
    pending and later call on it fails on every survivor; ``.rank`` names the first lost rank
    and the message all of them (see :mod:`ringcomm.elastic`)."""


class FrameError(CommError):
    """A frame from the network is malformed, truncated, oversized or foreign."""


class SignatureMismatch(CollectiveMismatch):
    """Internal: a message's collective signature differs from this rank's.

    Carries the raw signatures so the communicator can describe both sides in words.
    """

    def __init__(self, src, theirs, ours):
        super().__init__(f"rank {src} sent signature {theirs.hex()}, this rank expects {ours.hex()}")
        self.src, self.theirs, self.ours = src, theirs, ours
