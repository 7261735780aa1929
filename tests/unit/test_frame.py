"""The wire header: round trip, every rejection, and a fuzz test (ringcomm.transport.frame)."""
import struct

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ringcomm.errors import CommError, FrameError
from ringcomm.transport import frame
from ringcomm.transport.frame import (HEADER, MAGIC, MAX_ABORT_BYTES, MAX_AGREE_BYTES, VERSION, Header, Key, Kind,
                                     Space)

pytestmark = pytest.mark.timeout(30)

U32 = st.integers(0, 2 ** 32 - 1)
U64 = st.integers(0, 2 ** 64 - 1)
SIG = st.binary(min_size=16, max_size=16)

# byte offsets of the fields in the 56-byte header ("<4sBBBxIIQIIQ16s")
OFF_MAGIC, OFF_VERSION, OFF_KIND, OFF_SPACE, OFF_PAD = 0, 4, 5, 6, 7
OFF_SRC, OFF_COMM, OFF_SEQ, OFF_STEP, OFF_SEG, OFF_NBYTES, OFF_SIG = 8, 12, 16, 24, 28, 32, 40


def test_header_layout():
    assert HEADER.size == 56
    raw = frame.pack(Kind.DATA, 3, Key(0x11, 1, 0x22, 0x33, 0x44), 0x55, bytes(range(16)))
    assert len(raw) == 56
    assert raw[OFF_MAGIC:OFF_MAGIC + 4] == b"RCM1"
    assert raw[OFF_VERSION] == VERSION == 7
    assert raw[OFF_KIND] == Kind.DATA
    assert raw[OFF_SPACE] == 1
    assert raw[OFF_PAD] == 0
    assert struct.unpack_from("<I", raw, OFF_SRC)[0] == 3
    assert struct.unpack_from("<I", raw, OFF_COMM)[0] == 0x11
    assert struct.unpack_from("<Q", raw, OFF_SEQ)[0] == 0x22
    assert struct.unpack_from("<I", raw, OFF_STEP)[0] == 0x33
    assert struct.unpack_from("<I", raw, OFF_SEG)[0] == 0x44
    assert struct.unpack_from("<Q", raw, OFF_NBYTES)[0] == 0x55
    assert raw[OFF_SIG:] == bytes(range(16))


@st.composite
def messages(draw):
    world = draw(st.integers(2, 2 ** 32 - 1))
    src = draw(st.integers(0, world - 1))
    self_rank = draw(st.integers(0, world - 1).filter(lambda r: r != src))
    kind = draw(st.sampled_from(list(Kind)))
    key = Key(draw(U32), draw(st.sampled_from(list(Space))), draw(U64), draw(U32), draw(U32))
    limit = {Kind.ABORT: MAX_ABORT_BYTES, Kind.AGREE: MAX_AGREE_BYTES}.get(kind)
    nbytes = draw(U64 if limit is None else st.integers(0, limit))
    return kind, src, key, nbytes, draw(SIG), world, self_rank


@given(messages())
@settings(max_examples=300)
def test_round_trip(msg):
    kind, src, key, nbytes, sig, world, self_rank = msg
    raw = frame.pack(kind, src, key, nbytes, sig)
    frame_len = frame.SHM_NOTICE_BYTES if kind == Kind.SHM else nbytes
    header = frame.unpack(raw, frame_len, world, self_rank)
    assert header == Header(kind, src, key, nbytes, sig)
    assert type(header.kind) is Kind
    assert type(header.key) is Key
    assert type(header.key.space) is Space


def test_unpack_accepts_bytearray_and_memoryview():
    raw = frame.pack(Kind.BYE, 1, Key(0, 0, 0, 0, 0), 0, bytes(16))
    for buf in (bytearray(raw), memoryview(raw)):
        assert frame.unpack(buf, 0, 2, 0).kind is Kind.BYE


# -- rejections ---------------------------------------------------------------------------------

GOOD = dict(kind=Kind.DATA, src=1, key=Key(7, 0, 9, 2, 3), nbytes=12, sig=b"s" * 16)


def good_raw(**changes):
    fields = {**GOOD, **changes}
    return frame.pack(fields["kind"], fields["src"], fields["key"], fields["nbytes"], fields["sig"])


def patched(raw, offset, value):
    return raw[:offset] + value + raw[offset + len(value):]


@pytest.mark.parametrize("frame_len", [0, 12, 63, 65])
def test_rejects_shared_memory_notice_of_wrong_length(frame_len):
    # an SHM header's nbytes is the data's length in the slot; its frame is the notice
    raw = good_raw(kind=Kind.SHM, nbytes=1 << 20)
    assert frame.unpack(raw, frame.SHM_NOTICE_BYTES, 4, 0).nbytes == 1 << 20
    with pytest.raises(FrameError, match="notice"):
        frame.unpack(raw, frame_len, 4, 0)


def test_good_header_is_accepted():
    assert frame.unpack(good_raw(), 12, 4, 0).src == 1


@pytest.mark.parametrize("magic", [b"RCM0", b"rcm1", b"\0\0\0\0", b"ZMQ1"])
def test_rejects_bad_magic(magic):
    with pytest.raises(FrameError, match="foreign"):
        frame.unpack(patched(good_raw(), OFF_MAGIC, magic), 12, 4, 0)


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5, 6, 8, 255])
def test_rejects_wrong_version(version):
    with pytest.raises(FrameError, match="version"):
        frame.unpack(patched(good_raw(), OFF_VERSION, bytes([version])), 12, 4, 0)


@pytest.mark.parametrize("kind", [0, 12, 13, 255])
def test_rejects_unknown_kind(kind):
    with pytest.raises(FrameError, match="kind"):
        frame.unpack(patched(good_raw(), OFF_KIND, bytes([kind])), 12, 4, 0)


@pytest.mark.parametrize("space", [2, 3, 255])
def test_rejects_bad_space(space):
    with pytest.raises(FrameError, match="space"):
        frame.unpack(patched(good_raw(), OFF_SPACE, bytes([space])), 12, 4, 0)


@pytest.mark.parametrize("src, world, self_rank", [
    (4, 4, 0),            # src == world size
    (2 ** 32 - 1, 4, 0),  # far out of range
    (1, 1, 0),            # any src in a world of one
    (2, 4, 2),            # a frame claiming to come from this very rank
    (0, 4, 0),
])
def test_rejects_src_out_of_range_or_self(src, world, self_rank):
    with pytest.raises(FrameError, match="rank"):
        frame.unpack(good_raw(src=src), 12, world, self_rank)


@pytest.mark.parametrize("payload_len", [0, 11, 13, 2 ** 40])
def test_rejects_nbytes_not_matching_payload(payload_len):
    with pytest.raises(FrameError, match="payload"):
        frame.unpack(good_raw(nbytes=12), payload_len, 4, 0)


def test_abort_size_limit():
    raw = good_raw(kind=Kind.ABORT, nbytes=MAX_ABORT_BYTES)
    assert frame.unpack(raw, MAX_ABORT_BYTES, 4, 0).kind is Kind.ABORT
    raw = good_raw(kind=Kind.ABORT, nbytes=MAX_ABORT_BYTES + 1)
    with pytest.raises(FrameError, match="abort"):
        frame.unpack(raw, MAX_ABORT_BYTES + 1, 4, 0)
    # the limit is for aborts only: a data frame may be larger
    raw = good_raw(nbytes=MAX_ABORT_BYTES + 1)
    assert frame.unpack(raw, MAX_ABORT_BYTES + 1, 4, 0).nbytes == MAX_ABORT_BYTES + 1


def test_agreement_size_limit():
    raw = good_raw(kind=Kind.AGREE, nbytes=MAX_AGREE_BYTES)
    assert frame.unpack(raw, MAX_AGREE_BYTES, 4, 0).kind is Kind.AGREE
    raw = good_raw(kind=Kind.AGREE, nbytes=MAX_AGREE_BYTES + 1)
    with pytest.raises(FrameError, match="agreement"):
        frame.unpack(raw, MAX_AGREE_BYTES + 1, 4, 0)


@pytest.mark.parametrize("length", [0, 1, 55, 57, 112])
def test_rejects_wrong_header_length(length):
    raw = (good_raw() * 3)[:length]
    with pytest.raises(FrameError, match="header"):
        frame.unpack(raw, 12, 4, 0)


def test_frame_error_is_comm_error():
    assert issubclass(FrameError, CommError)


# -- fuzz ----------------------------------------------------------------------------------------

def check_unpack(raw, payload_len, world, self_rank):
    """``unpack`` either returns a consistent Header or raises FrameError, nothing else."""
    try:
        header = frame.unpack(raw, payload_len, world, self_rank)
    except FrameError:
        return None
    assert isinstance(header, Header)
    assert len(raw) == HEADER.size and bytes(raw[:4]) == MAGIC
    assert 0 <= header.src < world and header.src != self_rank
    # a notice stands for a segment in a shared-memory slot: nbytes is the segment's length
    assert header.nbytes == payload_len or (header.kind == Kind.SHM and payload_len == frame.SHM_NOTICE_BYTES)
    assert header.key.space in (0, 1)
    # re-packing it gives the same bytes, except the ignored pad byte
    repacked = frame.pack(header.kind, header.src, header.key, header.nbytes, header.sig)
    assert repacked[:OFF_PAD] == bytes(raw[:OFF_PAD])
    assert repacked[OFF_PAD + 1:] == bytes(raw[OFF_PAD + 1:])
    return header


@given(raw=st.binary(max_size=120), payload_len=st.integers(0, 2 ** 64),
       world=st.integers(1, 2 ** 33), self_rank=st.integers(0, 2 ** 33))
@settings(max_examples=300)
def test_fuzz_arbitrary_bytes(raw, payload_len, world, self_rank):
    check_unpack(raw, payload_len, world, self_rank)


@given(raw=st.binary(min_size=56, max_size=56), payload_len=st.integers(0, 5000),
       world=st.integers(1, 8), self_rank=st.integers(0, 7))
@settings(max_examples=300)
def test_fuzz_header_sized_bytes_with_magic(raw, payload_len, world, self_rank):
    # start with the right magic and version so the later checks are reached
    check_unpack(MAGIC + bytes([VERSION]) + raw[5:], payload_len, world, self_rank)


@given(msg=messages(), mutations=st.lists(
    st.tuples(st.integers(0, 55), st.integers(0, 255)), min_size=1, max_size=4),
    payload_delta=st.sampled_from([0, 0, 0, 1, -1]))
@settings(max_examples=200)
def test_fuzz_mutated_valid_headers(msg, mutations, payload_delta):
    kind, src, key, nbytes, sig, world, self_rank = msg
    raw = bytearray(frame.pack(kind, src, key, nbytes, sig))
    for offset, value in mutations:
        raw[offset] = value
    payload_len = nbytes + payload_delta
    assume(payload_len >= 0)
    check_unpack(bytes(raw), payload_len, world, self_rank)
