"""The stand-in's GPU: devices, streams, events, and host memory CUDA knows as pinned.

Work launched on a stream (a kernel, an element-wise operation, a copy) is **deferred**: it
is queued on the stream and carried out only when something forces it, in stream order:

- ``stream.synchronize()``, ``event.synchronize()``, ``Device.synchronize()``: the host waits
  (each counted as a ``host sync``, and as a ``host wait`` when work was still queued; so is
  every operation whose result's shape or value the host needs: a boolean mask, a scalar);
- ``event.done`` carries out one more operation of the event's stream per query that finds
  it pending (and the waits before it whose event has passed, which take no time on a GPU);
- an operation queued on stream B after ``B.wait_event(e)`` first completes e's stream up to
  the point where ``e`` was recorded;
- on the legacy null stream (the default unless ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``)
  CUDA's implicit order: null-stream work follows earlier work of every *blocking* stream of
  its device, and a blocking stream's work follows earlier null-stream work. Streams made
  with ``non_blocking=True`` and per-thread default streams have no implicit order at all.

The default streams are handles, not streams of a device: the legacy null stream (handle 0)
and the per-thread default stream (handle 2) denote the stream of whichever device is
current where they are used (a launch, a record, a wait), as in CUDA; ``get_current_stream(1)``
used while device 0 is current orders device 0's work. An event belongs to the device
current when it was made, and recording it on another device's stream fails.

So a reader that does not wait for a writer on another stream reads what was there before
(fresh device memory holds a poison pattern: NaN or -1), exactly the bug a GPU shows only
sometimes. The current device and each device's current stream are per thread, as in CUDA.
"""
import collections
import itertools
import os
import threading
import weakref

LOCK = threading.RLock()  # deferred work runs under it, on whichever thread forces it
PER_THREAD_DEFAULT = os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "0") == "1"
DEVICE_COUNT = int(os.environ.get("CUPY_STANDIN_DEVICES", "4"))
_local = threading.local()
_streams = weakref.WeakSet()
counts = collections.Counter()  # "operations" queued, "kernels" launched, by what


class CUDARuntimeError(RuntimeError):
    pass


def current_device():
    return getattr(_local, "device", 0)


def set_device(index):
    if not 0 <= index < DEVICE_COUNT:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {index} of {DEVICE_COUNT}")
    _local.device = index


class Stream:
    """A CUDA stream of the device current when it is made; see the module docstring."""

    def __init__(self, null=False, non_blocking=False, ptds=False, device=None):
        self.device_id = current_device() if device is None else device
        self.null, self.non_blocking, self.ptds = null, non_blocking, ptds
        self._queue = collections.deque()  # (position, fn) not yet carried out
        self._count = 0   # operations queued so far
        self._done = 0    # operations carried out so far
        _streams.add(self)

    def __repr__(self):
        kind = "null" if self.null else "per-thread default" if self.ptds else \
            "non-blocking" if self.non_blocking else "blocking"
        return f"<standin {kind} stream on device {self.device_id}>"

    @property
    def _blocking(self):
        return not (self.null or self.non_blocking or self.ptds)

    def resolved(self, device=None):
        """This stream (a :class:`DefaultHandle` resolves to a device's default stream)."""
        return self

    def launch(self, fn, what="work", any_device=False):
        """Queue ``fn`` on this stream: a kernel's stream must be of this thread's current
        device; a copy or an event wait (``any_device``) may go to any device's stream."""
        if not any_device and self.device_id != current_device():
            raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: {what} on a stream of device "
                                   f"{self.device_id} while device {current_device()} is current")
        with LOCK:
            if self.null and not PER_THREAD_DEFAULT:
                for other in list(_streams):
                    if other._blocking and other.device_id == self.device_id and other._count > other._done:
                        self._append(_until(other, other._count))
            elif self._blocking:
                null = null_stream(self.device_id)
                if null._count > null._done:
                    self._append(_until(null, null._count))
            self._append(fn)
            counts["operations"] += 1
            counts[f"on device {self.device_id}"] += 1

    def _append(self, fn):
        self._queue.append((self._count, fn))
        self._count += 1

    def run_until(self, position):
        with LOCK:
            while self._done < position:
                _, fn = self._queue.popleft()
                fn()
                self._done += 1

    def synchronize(self):
        _host_waits(self, self._count)
        self.run_until(self._count)

    def _drain(self):
        self.run_until(self._count)

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        if event._stream is not None:  # the event's stream may be of any device: CUDA allows it
            self.launch(_until(event._stream, event._position), "wait_event", any_device=True)

    def _check_device(self):
        if self.device_id != current_device():
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) does not "
                               f"match the current device ({current_device()})")

    def __enter__(self):
        self._check_device()
        streams = _current_streams()
        _entered().append((self.device_id, streams.get(self.device_id)))
        streams[self.device_id] = self
        return self

    def __exit__(self, *exc):
        device, previous = _entered().pop()
        streams = _current_streams()
        if previous is None:
            streams.pop(device, None)
        else:
            streams[device] = previous


def _entered():
    """This thread's stack of (device, the stream current before a ``with stream``)."""
    stack = getattr(_local, "entered", None)
    if stack is None:
        stack = _local.entered = []
    return stack


class _Until:
    """A stream's wait for ``stream`` to pass ``position`` (an event, or CUDA's implicit
    order): carrying it out carries out that stream up to there."""

    __slots__ = ("stream", "position")

    def __init__(self, stream, position):
        self.stream, self.position = stream, position

    def __call__(self):
        self.stream.run_until(self.position)

    @property
    def passed(self):
        """The awaited point is behind, or only waits that have passed stand before it: on
        a GPU this wait costs nothing."""
        stream = self.stream
        pending = self.position - stream._done
        return pending <= 0 or all(getattr(fn, "passed", False)
                                   for _, fn in itertools.islice(stream._queue, pending))


_until = _Until


_null = {}


def null_stream(device_id):
    with LOCK:
        if device_id not in _null:
            _null[device_id] = Stream(null=True, device=device_id)
        return _null[device_id]


def _current_streams():
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    return streams


class DefaultHandle:
    """The default stream as CuPy hands it out when no stream was made current (its
    ``Stream.null`` or ``Stream.ptds``): a handle of no device (``device_id`` -1) that
    means the default stream of whichever device is current where it is used."""

    device_id, non_blocking = -1, False

    def __init__(self, ptds):
        self.ptds, self.null = ptds, not ptds

    def __repr__(self):
        return f"<standin {'per-thread default' if self.ptds else 'null'} stream handle>"

    def resolved(self, device=None):
        """The stream this handle means while ``device`` (default: the current one) is current."""
        return default_stream(current_device() if device is None else device, self.ptds)

    def launch(self, fn, what="work", any_device=False):
        return self.resolved().launch(fn, what, any_device)

    def synchronize(self):
        self.resolved().synchronize()

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        self.resolved().wait_event(event)

    def __enter__(self):  # any device may make the default stream current (CuPy's rule)
        device, streams = current_device(), _current_streams()
        _entered().append((device, streams.get(device)))
        streams[device] = self
        return self

    __exit__ = Stream.__exit__


NULL_HANDLE, PTDS_HANDLE = DefaultHandle(ptds=False), DefaultHandle(ptds=True)


def default_stream(device, ptds=PER_THREAD_DEFAULT):
    """``device``'s legacy null stream, or this thread's per-thread default stream of it."""
    if not ptds:
        return null_stream(device)
    defaults = getattr(_local, "defaults", None)
    if defaults is None:
        defaults = _local.defaults = {}
    if device not in defaults:
        defaults[device] = Stream(ptds=True, device=device)
    return defaults[device]


def current_stream(device=None):
    """This thread's current stream of ``device`` (default: its current device): one set
    with ``with stream``, else the default stream's handle (which means the device current
    where it is used, see the module docstring)."""
    device = current_device() if device is None else device
    stream = _current_streams().get(device)
    if stream is not None:
        return stream
    return PTDS_HANDLE if PER_THREAD_DEFAULT else NULL_HANDLE


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        counts["events"] += 1
        self.device_id = current_device()  # an event belongs to the device current when made
        self._stream, self._position = None, 0

    def record(self, stream=None):
        stream = (stream or current_stream()).resolved()
        if stream.device_id != self.device_id:
            raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: an event of device {self.device_id} "
                                   f"recorded on a stream of device {stream.device_id}")
        self._stream, self._position = stream, stream._count

    def synchronize(self):
        if self._stream is not None:
            _host_waits(self._stream, self._position)
            self._stream.run_until(self._position)

    @property
    def done(self):
        """Whether the stream has passed the event. This GPU moves only when asked: a query
        that finds the event pending carries out one more operation of its stream and says
        "not yet", so a poller sees what it would see on a busy GPU."""
        stream = self._stream
        if stream is None:
            return True
        with LOCK:
            # waits already satisfied take no time on a GPU: they go by with the next operation
            while stream._done < self._position and getattr(stream._queue[0][1], "passed", False):
                stream.run_until(stream._done + 1)
            if stream._done >= self._position:
                return True
            stream.run_until(stream._done + 1)
            return False


def _host_waits(stream, position, pending=None):
    """Count a synchronisation of ``stream`` up to ``position`` ("host syncs": each one
    stops the host until the GPU is there, which a training step can afford once) and,
    when it finds work still queued (``pending``, by default that stream's), a wait ("host
    waits": on a GPU the host would block)."""
    counts["host syncs"] += 1
    if (stream._done < position) if pending is None else pending:
        counts["host waits"] += 1



def synchronize_device(device_id=None):
    device_id = current_device() if device_id is None else device_id
    with LOCK:
        streams = [s for s in list(_streams) if s.device_id == device_id]
        null = null_stream(device_id)  # one synchronisation, of the device's default stream and all
        _host_waits(null, null._count, pending=any(s._done < s._count for s in streams))
        for stream in streams:
            stream._drain()


# -- host memory CUDA knows about --------------------------------------------------------------

_pinned = {}  # start address -> end address
pinned_bytes = {"allocated": 0}  # by kind: cupyx's allocations, "registered" host memory


def _address(host):
    return host.__array_interface__["data"][0]


def pin(host):
    """Count ``host`` (a fresh numpy allocation) as page-locked until it is freed."""
    start = _address(host)
    with LOCK:
        _pinned[start] = start + host.nbytes
        pinned_bytes["allocated"] += host.nbytes
    weakref.finalize(host, _unpin, start)


def _unpin(start):
    with LOCK:
        pinned_bytes["allocated"] -= _pinned.pop(start) - start


def register(address, nbytes):
    """``cudaHostRegister``: ``nbytes`` of host memory at ``address`` become page-locked."""
    with LOCK:
        if any(s < address + nbytes and address < e for s, e in _pinned.items()):
            raise CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        _pinned[address] = address + nbytes
        pinned_bytes["registered"] = pinned_bytes.get("registered", 0) + nbytes


def unregister(address):
    with LOCK:
        if address not in _pinned:
            raise CUDARuntimeError("cudaErrorHostMemoryNotRegistered")
        pinned_bytes["registered"] -= _pinned.pop(address) - address


def is_pinned(host):
    return is_pinned_range(_address(host), host.nbytes)


def is_pinned_range(start, nbytes):
    with LOCK:
        return any(s <= start and start + nbytes <= e for s, e in _pinned.items())


def report(path):
    """Write what this process did on the stand-in's GPU to ``path`` (JSON), at exit."""
    import atexit
    import json

    from ._array import allocated

    def write():
        with open(path, "w") as f:
            json.dump({**counts, "device_peak_bytes": allocated["peak"],
                       "pinned_bytes": dict(pinned_bytes)}, f)
    atexit.register(write)


if os.environ.get("CUPY_STANDIN_REPORT"):
    report(os.path.join(os.environ["CUPY_STANDIN_REPORT"], f"{os.getpid()}.json"))
