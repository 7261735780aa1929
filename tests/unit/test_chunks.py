"""Properties of how a flat buffer is cut into chunks and segments (ringcomm.algorithms.chunks)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.algorithms.chunks import chunk_bounds, num_segments, segment_table, segments, split

pytestmark = pytest.mark.timeout(30)

COUNTS = st.integers(min_value=0, max_value=5000)
RANKS = st.integers(min_value=1, max_value=17)
ITEMSIZES = st.sampled_from([1, 2, 4, 8])
SEGMENT_BYTES = st.integers(min_value=1, max_value=4096)


def assert_partition(bounds, start, stop):
    """``bounds`` cover [start, stop) contiguously, in order, with no overlap or gap."""
    assert bounds[0][0] == start
    assert bounds[-1][1] == stop
    for (_, hi), (next_lo, _) in zip(bounds, bounds[1:], strict=False):
        assert hi == next_lo
    for lo, hi in bounds:
        assert lo <= hi


def lengths(bounds):
    return [hi - lo for lo, hi in bounds]


def slice_bounds(slices):
    for sl in slices:
        assert sl.step is None
    return [(sl.start, sl.stop) for sl in slices]


# -- split / chunk_bounds ------------------------------------------------------------------

def test_documented_examples():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split(0, 3, 2) == [(0, 2), (2, 3)]


@given(start=st.integers(-1000, 1000), length=st.integers(0, 3000), parts=RANKS)
def test_split_partitions_range_evenly_longer_first(start, length, parts):
    stop = start + length
    bounds = split(start, stop, parts)
    assert len(bounds) == parts
    assert_partition(bounds, start, stop)
    lens = lengths(bounds)
    assert max(lens) - min(lens) <= 1
    assert lens == sorted(lens, reverse=True)  # the longer ones come first
    assert sum(lens) == length
    # exactly length % parts of them carry the extra element
    assert lens.count(length // parts + 1) == length % parts


@given(count=COUNTS, n=RANKS)
def test_chunk_bounds_is_split_of_whole_buffer(count, n):
    bounds = chunk_bounds(count, n)
    assert bounds == split(0, count, n)
    assert len(bounds) == n
    assert_partition(bounds, 0, count)
    lens = lengths(bounds)
    assert max(lens) - min(lens) <= 1
    assert lens == sorted(lens, reverse=True)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_chunk_bounds_count_zero_gives_n_empty_chunks(n):
    assert chunk_bounds(0, n) == [(0, 0)] * n


@given(data=st.data(), n=st.integers(2, 17))
def test_chunk_bounds_count_below_n(data, n):
    count = data.draw(st.integers(1, n - 1))
    bounds = chunk_bounds(count, n)
    # the first `count` chunks hold one element each, the rest are empty
    assert lengths(bounds) == [1] * count + [0] * (n - count)
    assert_partition(bounds, 0, count)


# -- num_segments ---------------------------------------------------------------------------

@given(max_elems=COUNTS, itemsize=ITEMSIZES, segment_bytes=SEGMENT_BYTES)
def test_num_segments_enough_and_minimal(max_elems, itemsize, segment_bytes):
    nseg = num_segments(max_elems, itemsize, segment_bytes)
    assert nseg >= 1
    per_segment = max(1, segment_bytes // itemsize)
    longest = -(-max_elems // nseg)  # split() makes the longest piece ceil(max/nseg)
    assert longest <= per_segment
    if itemsize <= segment_bytes:
        assert longest * itemsize <= segment_bytes
    if nseg > 1:  # one fewer segment would be too few
        assert -(-max_elems // (nseg - 1)) > per_segment


def test_num_segments_examples():
    assert num_segments(0, 4, 64) == 1
    assert num_segments(16, 4, 64) == 1
    assert num_segments(17, 4, 64) == 2
    assert num_segments(100, 8, 64) == 13
    # an element larger than a segment: one element per segment
    assert num_segments(5, 8, 3) == 5


# -- segment_table ----------------------------------------------------------------------------

@given(count=COUNTS, n=RANKS, itemsize=ITEMSIZES, segment_bytes=SEGMENT_BYTES)
@settings(max_examples=150)
def test_segment_table_properties(count, n, itemsize, segment_bytes):
    table = segment_table(count, n, itemsize, segment_bytes)
    chunks = chunk_bounds(count, n)
    assert len(table) == n
    nsegs = {len(row) for row in table}
    assert len(nsegs) == 1, "every chunk must have the same number of segments"
    (nseg,) = nsegs
    assert nseg == num_segments(chunks[0][1] - chunks[0][0], itemsize, segment_bytes)
    for (c0, c1), row in zip(chunks, table, strict=True):
        bounds = slice_bounds(row)
        assert_partition(bounds, c0, c1)
        lens = lengths(bounds)
        assert max(lens) - min(lens) <= 1
        assert lens == sorted(lens, reverse=True)
        if itemsize <= segment_bytes:
            assert all(length * itemsize <= segment_bytes for length in lens)
        else:
            assert all(length <= 1 for length in lens)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_segment_table_count_zero(n):
    table = segment_table(0, n, 4, 64)
    assert table == [[slice(0, 0)]] * n


def test_segment_table_count_below_n_has_empty_chunks():
    table = segment_table(2, 5, 8, 64)
    assert [slice_bounds(row) for row in table] == [
        [(0, 1)], [(1, 2)], [(2, 2)], [(2, 2)], [(2, 2)]]


def test_segment_table_pipelines_chunks_into_equal_segment_counts():
    # 10 float32 on 3 ranks: chunks of 4, 3, 3 elements; 8-byte segments -> 2 per chunk
    table = segment_table(10, 3, 4, 8)
    assert [slice_bounds(row) for row in table] == [
        [(0, 2), (2, 4)], [(4, 6), (6, 7)], [(7, 9), (9, 10)]]


# -- segments -----------------------------------------------------------------------------------

@given(count=COUNTS, itemsize=ITEMSIZES, segment_bytes=SEGMENT_BYTES)
def test_segments_cover_buffer_within_size(count, itemsize, segment_bytes):
    segs = segments(count, itemsize, segment_bytes)
    bounds = slice_bounds(segs)
    assert len(segs) == num_segments(count, itemsize, segment_bytes)
    assert_partition(bounds, 0, count)
    lens = lengths(bounds)
    assert max(lens) - min(lens) <= 1
    assert lens == sorted(lens, reverse=True)
    if itemsize <= segment_bytes:
        assert all(length * itemsize <= segment_bytes for length in lens)


def test_segments_count_zero_is_one_empty_segment():
    assert segments(0, 4, 64) == [slice(0, 0)]
