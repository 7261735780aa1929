"""Training data and the order in which it is read.

- **Synthetic** (default): ``x ~ N(0, 1)`` of the model's input width, labels from a fixed
  random *teacher* network ``argmax(relu(x @ A) @ B)``, all deterministic from the seed, no
  download. A small MLP learns it well above chance (1/classes).
- ``--data FILE.npz``: arrays ``x`` (samples × features, finite) and ``y`` (labels: whole
  numbers in ``[0, classes)``, classes being the width of the last layer); optional
  ``x_test``/``y_test`` for the reported accuracy. A row that breaks this is refused by
  number (a NaN input makes the loss and every gradient NaN; a label -1 would index the
  last class, and 2.7 would be read as 2).

Batches: a global batch of ``B`` samples is taken in a fixed order from the seed (a new
permutation each epoch); rank r of N reads rows ``[r·B/N, (r+1)·B/N)`` of every global
batch. ``B`` equal to the dataset size means full-batch training.
"""
from dataclasses import dataclass

import numpy as np


@dataclass
class Dataset:
    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self):
        return int(max(self.y.max(), self.y_test.max())) + 1


def synthetic(features, classes, samples, seed, test_samples=2048):
    rng = np.random.default_rng([seed, 1234])
    teacher_hidden = 2 * features
    A = rng.standard_normal((features, teacher_hidden)) / np.sqrt(features)
    B = rng.standard_normal((teacher_hidden, classes)) / np.sqrt(teacher_hidden)
    x = rng.standard_normal((samples + test_samples, features)).astype(np.float32)
    y = (np.maximum(x @ A, 0) @ B).argmax(axis=1).astype(np.int64)
    return Dataset(x[:samples], y[:samples], x[samples:], y[samples:])


def load_npz(path, classes=None):
    """The dataset in ``path``, every input finite and every label a whole number in ``[0,
    classes)`` (``classes`` None: any label >= 0); ValueError naming the first bad row."""
    loaded = np.load(path)
    if not isinstance(loaded, np.lib.npyio.NpzFile):  # a .npy holds one array, no labels
        raise ValueError(f"{path}: needs an .npz file with arrays 'x' and 'y' (np.savez), got "
                         f"one array")
    with loaded as f:
        if "x" not in f or "y" not in f:
            raise ValueError(f"{path}: needs arrays 'x' and 'y', found {sorted(f.files)}")
        if ("x_test" in f) != ("y_test" in f):
            raise ValueError(f"{path}: held-out data needs both x_test and y_test, or neither")
        arrays = {k: f[k] for k in ("x", "y", "x_test", "y_test") if k in f}
    for xs, ys in (("x", "y"), ("x_test", "y_test")):
        if xs in arrays:
            x, y = arrays[xs], arrays[ys]
            if x.ndim != 2 or y.shape != (len(x),):
                raise ValueError(f"{path}: {xs} must be 2-D and {ys} 1-D of the same length, got "
                                 f"{x.shape}, {y.shape}")
            arrays[xs], arrays[ys] = _inputs(path, xs, x), _labels(path, ys, y, classes)
    x, y = arrays["x"], arrays["y"]
    if "x_test" in arrays and arrays["x_test"].shape[1] != x.shape[1]:
        raise ValueError(f"{path}: x_test has {arrays['x_test'].shape[1]} features a row, x has "
                         f"{x.shape[1]}")
    return Dataset(x, y, arrays.get("x_test", x), arrays.get("y_test", y))


def _real(dtype):
    return dtype.kind in "biuf"  # bool, signed and unsigned integers, floats


def _inputs(path, name, raw):
    """``raw`` as float32, refused at its first row holding a value that is not finite there."""
    if not _real(raw.dtype):
        raise ValueError(f"{path}: {name} must be real numbers, got dtype {raw.dtype}")
    with np.errstate(over="ignore"):  # too large for float32 becomes inf: refused below
        x = raw.astype(np.float32)
    bad = np.argwhere(~np.isfinite(x))
    if len(bad):
        row, column = bad[0]
        value = raw[row, column].item()
        what = f"{value}, beyond float32" if np.isfinite(value) else value
        raise ValueError(f"{path}: {name} row {row} is not finite (column {column} is {what}); "
                         f"inputs must be finite")
    return x


def _labels(path, name, raw, classes):
    """``raw`` as int64, refused at its first label that is not a whole number in [0, classes)."""
    if not _real(raw.dtype):
        raise ValueError(f"{path}: {name} must be integer labels, got dtype {raw.dtype}")
    raw = raw.astype(np.uint8) if raw.dtype.kind == "b" else raw  # False, True: classes 0 and 1
    with np.errstate(invalid="ignore"):  # NaN compares False: refused as not whole
        good = (raw == np.round(raw)) & (raw >= 0) & (raw < (np.inf if classes is None else classes))
    if not good.all():
        row = int(np.argmin(good))
        span = ">= 0" if classes is None else f"in [0, {classes}) (--layers ends with {classes})"
        raise ValueError(f"{path}: {name} row {row} is {raw[row].item()!r}; labels must be whole "
                         f"numbers {span}")
    return raw.astype(np.int64)


class BatchOrder:
    """Which rows form global batch ``step``, and which of them are this rank's."""

    def __init__(self, samples, batch_size, world_size, seed, uneven=False):
        if batch_size > samples:
            raise ValueError(f"--batch-size {batch_size} exceeds the {samples} training samples")
        if batch_size % world_size and not uneven:
            raise ValueError(f"--batch-size {batch_size} does not divide by the world size {world_size}")
        if batch_size < world_size:
            raise ValueError(f"--batch-size {batch_size} leaves some of the {world_size} ranks no rows")
        self.samples, self.batch_size, self.world_size, self.seed = samples, batch_size, world_size, seed
        self.per_epoch = samples // batch_size
        self._epoch, self._perm = None, None

    def global_rows(self, step):
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.samples)
        return self._perm[index * self.batch_size:(index + 1) * self.batch_size]

    def local_rows(self, step, rank):
        """Rank ``rank``'s share of the global batch: an equal one, or with ``uneven`` (a
        world shrunk by a loss) shares that differ by one row at most."""
        rows, n = self.global_rows(step), self.world_size
        return rows[rank * self.batch_size // n:(rank + 1) * self.batch_size // n]
