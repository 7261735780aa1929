"""The wire format: one fixed binary header, then the raw bytes of an array segment.

A message is a 56-byte header and a payload (possibly empty): one ZeroMQ frame holding both,
or two frames, the header and then the payload. Nothing is
ever unpickled: the header is a ``struct`` and the payload is read as raw array bytes by a
receiver that already knows the dtype and length it expects.

Header fields (little-endian):

====== ======= ===========================================================
magic  4 bytes ``RCM1``; anything else is a foreign frame
version u8     ``VERSION`` (7); another version is refused
kind   u8      DATA, BYE (the sender closed its communicator), ABORT, SHM (the payload
               is a notice naming a shared-memory slot that holds the data), LANE (the
               sender's shared-memory lane to the receiver is ready; see ``.shm``), PING
               (are you alive, and where are you in collective ``seq``?), PONG (the
               answer: ``step`` holds the state, see ``ringcomm.session``), CREDIT
               (the receiver took a point-to-point message: ``sig`` holds its byte count
               as a u64, see ``ringcomm.p2p``), WANT (the sender waits to send data of
               collective ``seq``), GRANT (the answer: ``seq`` holds how many collectives
               of the communicator the receiver has finished; see ``ringcomm.transport.credit``),
               AGREE (a message of the agreement on lost members: ``seq`` numbers the
               agreement within its communicator, ``step`` holds the message's kind and
               ``segment`` its round; see ``ringcomm.agreement``)
space  u8      :class:`Space`: 0 = collective, 1 = point-to-point
src    u32     the sender's global rank
comm   u32     communicator id (0 = world; groups get a hash)
seq    u64     sequence number of the collective within its communicator
step   u32     ring step (collectives) or tag (point-to-point)
segment u32    segment index within the step
nbytes u64     payload length; equals the payload frame's length (SHM: the data's length
               in the slot, the frame holding a ``SHM_NOTICE_BYTES`` notice)
sig    16 B    the collective's signature (see ``ringcomm.signature``)
====== ======= ===========================================================

(comm, space, seq, step, segment) together with src identify a message uniquely, so a late
or foreign message can never be taken for the one a rank is waiting for.
"""
import struct
from enum import IntEnum
from functools import partial
from typing import NamedTuple

from ..errors import FrameError

MAGIC = b"RCM1"
VERSION = 7  # 2: one-frame messages, SHM notices, LANE; 3: PING, PONG, CREDIT; 4: DOORBELL; 5: none;
# 6: WANT, GRANT; 7: AGREE
HEADER = struct.Struct("<4sBBBxIIQIIQ16s")
MAX_ABORT_BYTES = 4096  # an abort's payload is a UTF-8 reason, never larger than this
SHM_NOTICE_BYTES = 16   # see ringcomm.transport.shm.NOTICE
MAX_AGREE_BYTES = 1 << 16  # an agreement body (two bitmaps of the world) is never larger


class Kind(IntEnum):
    DATA = 1
    BYE = 2
    ABORT = 3
    SHM = 4
    LANE = 5
    PING = 6
    PONG = 7
    CREDIT = 8
    WANT = 9
    GRANT = 10
    AGREE = 11


class Space(IntEnum):
    """Which sequence a message's ``seq`` counts in: the communicator's collectives, or one
    route's point-to-point messages (see ``ringcomm.p2p``)."""

    COLLECTIVE = 0
    POINT_TO_POINT = 1


# the members under plain module names: reading an enum member off its class costs ~0.4 us
# on Python 3.11, and the mailbox tests a key's space several times per message
COLLECTIVE, POINT_TO_POINT = Space.COLLECTIVE, Space.POINT_TO_POINT


class Key(NamedTuple):
    """Where a message belongs: communicator, space, collective, step, segment."""

    comm_id: int
    space: Space
    seq: int
    step: int
    segment: int


class Header(NamedTuple):
    kind: Kind
    src: int
    key: Key
    nbytes: int
    sig: bytes


_KINDS = {kind.value: kind for kind in Kind}  # a dict lookup is ~10x cheaper than Kind(x)
_SPACES = {space.value: space for space in Space}
_SHM, _ABORT, _AGREE = int(Kind.SHM), int(Kind.ABORT), int(Kind.AGREE)  # int compares: cheaper than IntEnum's
# the namedtuples built from one tuple without their Python-level __new__ (a message
# makes two of them); new_key((comm_id, space, seq, step, segment)) is a Key
_new_header, new_key = partial(tuple.__new__, Header), partial(tuple.__new__, Key)


def pack(kind, src, key, nbytes, sig):
    """The header bytes of one message."""
    return HEADER.pack(MAGIC, VERSION, kind, key.space, src, key.comm_id, key.seq,
                       key.step, key.segment, nbytes, sig)


def unpack(header, payload_len, world_size, self_rank):
    """Parse and validate a header received from the network.

    Raises :class:`FrameError` for anything malformed, truncated, oversized or foreign.
    """
    if len(header) != HEADER.size:
        raise FrameError(f"header of {len(header)} bytes, expected {HEADER.size}")
    magic, version, kind, space, src, comm, seq, step, seg, nbytes, sig = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"foreign frame (magic {magic!r})")
    if version != VERSION:
        raise FrameError(f"wire version {version}, this rank speaks {VERSION}")
    kind = _KINDS.get(kind)
    if kind is None:
        raise FrameError(f"unknown message kind {HEADER.unpack(header)[2]}")
    space = _SPACES.get(space)
    if space is None:
        raise FrameError(f"unknown space {HEADER.unpack(header)[3]}")
    if not 0 <= src < world_size or src == self_rank:
        raise FrameError(f"frame claims to come from rank {src} (world size {world_size})")
    if kind == _SHM:
        if payload_len != SHM_NOTICE_BYTES:
            raise FrameError(f"shared-memory notice of {payload_len} bytes, expected {SHM_NOTICE_BYTES}")
    elif nbytes != payload_len:
        raise FrameError(f"header says {nbytes} payload bytes, frame has {payload_len}")
    if kind == _ABORT and nbytes > MAX_ABORT_BYTES:
        raise FrameError(f"abort reason of {nbytes} bytes exceeds {MAX_ABORT_BYTES}")
    if kind == _AGREE and nbytes > MAX_AGREE_BYTES:
        raise FrameError(f"agreement message of {nbytes} bytes exceeds {MAX_AGREE_BYTES}")
    return _new_header((kind, src, new_key((comm, space, seq, step, seg)), nbytes, sig))
