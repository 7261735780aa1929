"""What a goodbye says: a rank that closes after a failure names whom that failure blamed.

A rank that closes says BYE to every peer. A peer still waiting for it must not blame it when
it closed *because* of another rank: rank 0 that lost rank 2 in a receive and closed is not
the cause of rank 1's wait. So a BYE carries, in its header's ``sig`` (16 bytes), what the
closing rank's first failure (``Session.first_failure``, handed to the transport's close) blamed, laid out as an ABORT's
(``mailbox.ABORT_SIG``, ``<BIB10x``); the key fields, ``nbytes`` and the payload stay zero
and empty:

====== ==== ==============================================================================
code   u8   0: a plain goodbye (the whole ``sig`` is zero, as before any failure); else the
            error class of the first failure, coded as an ABORT codes it
            (``mailbox.ABORT_CLASSES``: 1 CollectiveMismatch, 2 CommTimeout, 3 PeerLost,
            4 any other error, 5 and 6 Revoked, 7 RanksLost)
rank   u32  the rank that failure blamed; 0xFFFFFFFF (``NO_RANK``): none
cause  u8   a timeout's cause (index in ``errors.TIMEOUT_CAUSES``)
====== ==== ==============================================================================

>>> reason(sig_for(PeerLost("lost", rank=2)), world_size=4)   # (PeerLost, 2, None)
>>> how_closed((PeerLost, 2, None), peer=0, me=1)             # ("closed after losing rank 2", 2)
"""
from ..errors import TIMEOUT_CAUSES, CommError, CommTimeout, PeerLost
from .mailbox import ABORT_CLASSES, ABORT_SIG, abort_sig

PLAIN = bytes(16)  # the sig of a goodbye after no failure


def sig_for(failure):
    """The ``sig`` of the BYE of a rank closing after ``failure`` (``None``: none)."""
    return PLAIN if failure is None else abort_sig(failure)


def reason(sig, world_size):
    """What a BYE's ``sig`` says: ``None`` for a plain goodbye, else ``(error class, the rank
    it blames or None, a timeout's cause or None)``."""
    code, blamed, cause = ABORT_SIG.unpack(sig)
    if code == 0:
        return None
    return (ABORT_CLASSES.get(code, CommError), blamed if blamed < world_size else None,
            TIMEOUT_CAUSES[cause] if cause < len(TIMEOUT_CAUSES) else None)


def how_closed(why, peer, me):
    """How ``peer``, which said BYE with :func:`reason` ``why``, closed, in words, and the
    rank to blame for it (the one its goodbye blames, else ``peer``); ``me``: this rank."""
    if why is None:
        return "closed its communicator", peer
    kind, blamed, cause = why
    if blamed is None or blamed == peer:
        return f"closed its communicator after a failure ({kind.__name__})", peer
    whom = f"rank {blamed}" + (" (this rank)" if blamed == me else "")
    if issubclass(kind, PeerLost):
        words = f"losing {whom}"
    elif kind is CommTimeout:
        words = f"timing out on {whom}" + {"silent": " (it stopped answering)",
                                           "not started": " (it never started the collective)"}.get(cause, "")
    else:
        words = f"a {kind.__name__} with {whom}"
    return f"closed after {words}", blamed
