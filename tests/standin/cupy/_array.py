"""The stand-in's ``cupy.ndarray``: numpy storage that behaves like device memory.

- It is its own type: ``isinstance(x, numpy.ndarray)`` is False, ``numpy.asarray(x)`` and any
  operation mixing it with a numpy array raise ``TypeError`` (CuPy's rule), and ``.get()``,
  ``cupy.asnumpy`` or ``.set()`` are the only ways across, each a copy on a stream.
- Every operation that computes runs on the current stream of the calling thread, deferred
  (see :mod:`._runtime`): its result is allocated at once, filled with poison, and written
  when the stream gets there. Metadata-only operations (basic slicing, reshape, transpose,
  view) return views at once, as CuPy does.
- Operations whose result's shape depends on the data (boolean masks, ``nonzero``,
  ``unique``...) and conversions to Python scalars synchronise the current stream and only it.
- Every operand must live on the current device (CuPy's rule without peer access).
"""
import numpy as np

from . import _runtime as rt

DATA_DEPENDENT = {"nonzero", "flatnonzero", "argwhere", "unique", "compress", "extract",
                  "array_equal", "allclose"}
allocated = {"bytes": 0, "peak": 0}  # device memory held by live buffers
POOL_ROUND = 512  # CuPy's memory pool rounds every allocation up to this
_free_blocks = {}  # (device, rounded size) -> blocks freed into the pool and not yet reused


def poison(shape, dtype):
    dtype = np.dtype(dtype)
    data = np.empty(shape, dtype)
    data.reshape(-1).view(np.uint8)[...] = 0xFF  # NaN for floats, -1 for integers, True for bools
    return data


class _Buffer:
    """One device allocation, from a model of CuPy's memory pool: a freed block is kept for
    the next allocation of its rounded size, and only a request the pool cannot serve is
    a "device malloc" (cudaMalloc, which a warmed-up training step should never need; the
    model splits and merges no blocks, so it counts at least as many as CuPy would)."""
    __slots__ = ("data", "device", "_block", "__weakref__")

    def __init__(self, data, device):
        self.data, self.device = data, device
        self._block = (device, -(-max(data.nbytes, 1) // POOL_ROUND) * POOL_ROUND)
        rt.counts["allocations"] += 1
        if _free_blocks.get(self._block, 0):
            _free_blocks[self._block] -= 1
        else:
            rt.counts["device mallocs"] += 1
        allocated["bytes"] += data.nbytes
        allocated["peak"] = max(allocated["peak"], allocated["bytes"])

    def __del__(self):
        allocated["bytes"] -= self.data.nbytes
        _free_blocks[self._block] = _free_blocks.get(self._block, 0) + 1


class ndarray:
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, *, _view=None, _buffer=None):
        if _view is None:
            _buffer = _Buffer(poison(shape, dtype), rt.current_device())
            _view = _buffer.data
        self._a, self._buffer = _view, _buffer

    @classmethod
    def _wrap(cls, view, buffer):
        return cls(None, _view=view, _buffer=buffer)

    # -- metadata ---------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self.transpose())

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"<standin cupy.ndarray shape={self.shape} dtype={self.dtype} device={self._buffer.device}>"

    @property
    def data(self):
        return _Pointer(self)

    # -- crossing to numpy --------------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` "
                        "to construct a NumPy array explicitly.")

    def get(self, stream=None, order="C", out=None, blocking=True):
        """Device -> host on ``stream`` (default: the current one). ``blocking`` (the default)
        waits for the copy; ``blocking=False`` into pinned ``out`` returns at once and the
        host sees the bytes only once the stream is synchronised."""
        # CuPy takes the current stream, then makes the array's device current for the copy
        # (where a default stream's handle means that device's)
        device = self._buffer.device
        stream = (stream or rt.current_stream()).resolved(device)
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif not isinstance(out, np.ndarray) or out.dtype != self.dtype:
            raise TypeError(f"out must be a numpy array of dtype {self.dtype}")
        elif out.shape != self.shape:
            raise ValueError(f"out must have shape {self.shape}")
        src = self._a
        stream.launch(lambda: np.copyto(out, src), "a device -> host copy", any_device=True)
        if blocking or not rt.is_pinned(out):  # a copy to pageable memory is synchronous
            stream.synchronize()
        return out

    def set(self, arr, stream=None):
        """Host -> device on ``stream``: from pinned memory the bytes are read when the stream
        gets there, by address, as a DMA engine reads them (the host must neither overwrite
        nor release them before: the copy keeps no Python object alive); from pageable
        memory now."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"set takes a numpy array, not {type(arr).__name__}")
        if arr.dtype != self.dtype:
            raise TypeError(f"set: dtype {arr.dtype} into {self.dtype}")
        if arr.shape != self.shape:
            raise ValueError(f"set: shape {arr.shape} into {self.shape}")
        stream = (stream or rt.current_stream()).resolved(self._buffer.device)  # as get()
        src = _by_address(arr) if rt.is_pinned(arr) else arr.copy()
        dst = self._a
        stream.launch(lambda: np.copyto(dst, src() if callable(src) else src), "a host -> device copy",
                      any_device=True)

    def __float__(self):
        return float(self._scalar())

    def __int__(self):
        return int(self._scalar())

    def __bool__(self):
        return bool(self._scalar())

    def __index__(self):
        return int(self._scalar())

    def _scalar(self):
        if self.size != 1:
            raise TypeError("only size-1 arrays convert to Python scalars")
        return self.get().reshape(())[()]

    def item(self):
        return self._scalar().item()

    def tolist(self):
        return self.get().tolist()

    # -- numpy protocols: everything computes through _apply ----------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = ufunc if method == "__call__" else getattr(ufunc, method)
        return apply(fn, inputs, kwargs, f"{ufunc.__name__}.{method}")

    def __array_function__(self, func, types, args, kwargs):
        return apply(func, args, kwargs, func.__name__)

    def __getitem__(self, key):
        key = _uploaded(key)
        if _is_basic(key):
            view = self._a[key]
            if not isinstance(view, np.ndarray):  # one element: a 0-d view, as CuPy gives
                keys = key if isinstance(key, tuple) else (key,)
                view = self._a[tuple(slice(k, k + 1 or None) if isinstance(k, (int, np.integer)) else k
                                     for k in keys)].reshape(())
            return ndarray._wrap(view, self._buffer)
        return apply(lambda a, k: a[k], (self, key), {}, "getitem",
                     data_dependent=_has_bool_mask(key))

    def __setitem__(self, key, value):
        key = _uploaded(key)
        _no_numpy((self, key, value), "setitem")
        for x in _fakes((self, key, value)):
            _check_device(x)
        if _has_bool_mask(key):  # CuPy counts the mask's True entries on the host first
            rt.current_stream().synchronize()
        dst, k, v = self._a, _real(key), _real(value)
        rt.current_stream().launch(lambda: dst.__setitem__(k, v), "setitem")

    def fill(self, value):
        self[...] = value

    def copy(self, order="C"):
        return apply(np.copy, (self,), {}, "copy")

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return apply(lambda a: a.astype(dtype), (self,), {}, "astype")

    def view(self, dtype=None):
        return ndarray._wrap(self._a.view(dtype), self._buffer)

    def __getattr__(self, name):  # the remaining ndarray methods: sum, max, reshape, ravel...
        method = getattr(np.ndarray, name, None)
        if method is None or name.startswith("_"):
            raise AttributeError(f"standin cupy.ndarray has no attribute {name!r}")
        return lambda *args, **kwargs: apply(lambda a, *r, **k: getattr(a, name)(*r, **k),
                                             (self, *args), kwargs, name)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _binary(ufunc, reflected=False, inplace=False):
    if inplace:
        return lambda self, other: apply(ufunc, (self, other), {"out": (self,)}, ufunc.__name__)
    if reflected:
        return lambda self, other: apply(ufunc, (other, self), {}, ufunc.__name__)
    return lambda self, other: apply(ufunc, (self, other), {}, ufunc.__name__)


for _name, _ufunc in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                      ("truediv", np.true_divide), ("floordiv", np.floor_divide), ("mod", np.remainder),
                      ("pow", np.power), ("matmul", np.matmul), ("and", np.bitwise_and),
                      ("or", np.bitwise_or), ("xor", np.bitwise_xor), ("lshift", np.left_shift),
                      ("rshift", np.right_shift)):
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
    setattr(ndarray, f"__r{_name}__", _binary(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _binary(_ufunc, inplace=True))
for _name, _ufunc in (("lt", np.less), ("le", np.less_equal), ("gt", np.greater),
                      ("ge", np.greater_equal), ("eq", np.equal), ("ne", np.not_equal)):
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
for _name, _ufunc in (("neg", np.negative), ("pos", np.positive), ("abs", np.absolute),
                      ("invert", np.invert)):
    setattr(ndarray, f"__{_name}__", lambda self, _u=_ufunc: apply(_u, (self,), {}, _u.__name__))
ndarray.__hash__ = None


def _by_address(arr):
    """What reads ``arr``'s bytes later without keeping ``arr`` (or what it views) alive."""
    import ctypes
    contiguous = np.ascontiguousarray(arr)
    if contiguous is not arr:  # a strided source: CuPy would have copied it first
        return contiguous
    address, shape, dtype, nbytes = arr.__array_interface__["data"][0], arr.shape, arr.dtype, arr.nbytes
    raw = ctypes.c_uint8 * nbytes

    def read():
        if not rt.is_pinned_range(address, nbytes):  # freed or unregistered before the copy ran
            raise rt.CUDARuntimeError("a host -> device copy from page-locked memory that was "
                                      "released before the copy ran")
        return np.frombuffer(raw.from_address(address), dtype).reshape(shape)
    return read


class _Pointer:
    def __init__(self, array):
        self.ptr = array._a.__array_interface__["data"][0]


# -- the one way an operation runs ------------------------------------------------------------

def _fakes(obj):
    if isinstance(obj, ndarray):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _fakes(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _fakes(x)


def _no_numpy(obj, what):
    if isinstance(obj, np.ndarray):
        raise TypeError(f"Unsupported type {type(obj)}: {what} mixes a numpy array with device "
                        f"arrays (move it with cupy.asarray first)")
    if isinstance(obj, (list, tuple)):
        for x in obj:
            _no_numpy(x, what)
    elif isinstance(obj, dict):
        for x in obj.values():
            _no_numpy(x, what)


def _check_device(x):
    if x._buffer.device != rt.current_device():
        raise ValueError(f"The device where the array resides ({x._buffer.device}) is different "
                         f"from the current device ({rt.current_device()}).")


def _map(obj, fn):
    if isinstance(obj, ndarray):
        return fn(obj)
    if isinstance(obj, list):
        return [_map(x, fn) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_map(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _real(obj):
    return _map(obj, lambda x: x._a)


def _uploaded(key):
    """``key`` with its numpy index arrays copied to the device, as CuPy's indexing takes
    them: a host -> device copy each time, counted as an "index upload" (a model that
    indexes with host arrays every step pays it every step)."""
    keys = key if isinstance(key, tuple) else (key,)
    if not any(isinstance(k, np.ndarray) for k in keys):
        return key
    moved = []
    for k in keys:
        if isinstance(k, np.ndarray):
            rt.counts["index uploads"] += 1
            device = ndarray(k.shape, k.dtype)
            device.set(k)
            k = device
        moved.append(k)
    return tuple(moved) if isinstance(key, tuple) else moved[0]


def _is_basic(key):
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, np.integer, slice)) and not isinstance(k, bool)
               for k in keys)


def _has_bool_mask(key):
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (ndarray, np.ndarray)) and k.dtype == np.bool_ or isinstance(k, list)
               and any(isinstance(v, bool) for v in k) for k in keys)


def _arrays(result):
    if isinstance(result, (list, tuple)):
        return [x for r in result for x in _arrays(r)]
    return [result] if isinstance(result, (np.ndarray, np.generic)) else []


def apply(func, args, kwargs, name, data_dependent=False):
    """``func(*args, **kwargs)`` on device arrays, as CuPy would run it (module docstring)."""
    _no_numpy((args, kwargs), name)
    fakes = list(_fakes((args, kwargs)))
    for x in fakes:
        _check_device(x)
    stream = rt.current_stream()
    if data_dependent or name in DATA_DEPENDENT:
        stream.synchronize()
        with np.errstate(all="ignore"):
            return _to_device_now(func(*_real(args), **_real(kwargs)))
    out = kwargs.get("out")
    if out is not None:  # in place into given device arrays
        outs = list(_fakes(out))
        if not outs:
            raise TypeError(f"{name}: out must be device arrays")
        dummies = {id(x): _dummy(x) for x in fakes}  # types and shapes fail now
        _quiet(func, _map(args, lambda x: dummies[id(x)]), _map(kwargs, lambda x: dummies[id(x)]))
        real_args, real_kwargs = _real(args), _real(kwargs)
        stream.launch(lambda: _quiet(func, real_args, real_kwargs), name)
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out
    dummies = {id(x): _dummy(x) for x in fakes}
    with np.errstate(all="ignore"):
        shape_of = func(*_map(args, lambda x: dummies[id(x)]), **_map(kwargs, lambda x: dummies[id(x)]))
    results = _arrays(shape_of)
    if not results and shape_of is not None:
        return shape_of  # a Python value that needs no data (a shape, a dtype)
    shares = [any(isinstance(r, np.ndarray) and np.shares_memory(r, d) for d in dummies.values()) for r in results]
    if results and all(shares):  # a view: no data is read, so it is taken at once
        real = func(*_real(args), **_real(kwargs))
        return _map_results(real, lambda r: ndarray._wrap(r, _owner(r, fakes)))
    if any(shares):
        raise NotImplementedError(f"standin: {name} returns views and copies together")
    out_arrays = [ndarray(np.shape(r), np.asarray(r).dtype) for r in results]
    real_args, real_kwargs = _real(args), _real(kwargs)
    targets = [o._a for o in out_arrays]

    def run():
        got = _arrays(_quiet(func, real_args, real_kwargs))
        for target, value in zip(targets, got, strict=True):
            np.copyto(target, value, casting="unsafe")
    stream.launch(run, name)
    it = iter(out_arrays)
    return _map_results(shape_of, lambda r: next(it))


def _dummy(x):
    """Zeros laid out as ``x`` is in its allocation (offset and strides alike), so that an
    operation tried on it returns a view exactly where it would on ``x`` (a reshape of a
    transposed view copies, as in CuPy)."""
    base, view = x._buffer.data, x._a
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    zeros = np.zeros(base.nbytes, np.uint8)
    return np.ndarray(view.shape, view.dtype, buffer=zeros, offset=offset, strides=view.strides)


def _quiet(func, args, kwargs):
    with np.errstate(all="ignore"):
        return func(*args, **kwargs)


def _owner(view, fakes):
    for x in fakes:
        if np.shares_memory(view, x._a):
            return x._buffer
    raise AssertionError("a view of no operand")


def _map_results(result, fn):
    if isinstance(result, (list, tuple)):
        return type(result)(_map_results(r, fn) for r in result)
    if isinstance(result, (np.ndarray, np.generic)):
        return fn(result)
    return result


def _to_device_now(result):
    """Results computed on synchronised data, written to device memory at once."""
    def move(r):
        r = np.asarray(r)
        out = ndarray(r.shape, r.dtype)
        out._a[...] = r
        return out
    return _map_results(result, move)
