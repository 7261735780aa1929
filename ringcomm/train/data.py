"""Training data and the order in which it is read.

- **Synthetic** (default): ``x ~ N(0, 1)`` of the model's input width, labels from a fixed
  random *teacher* network ``argmax(relu(x @ A) @ B)``, all deterministic from the seed, no
  download. A small MLP learns it well above chance (1/classes).
- ``--data FILE.npz``: arrays ``x`` (samples × features) and ``y`` (integer labels); optional
  ``x_test``/``y_test`` for the reported accuracy.

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


def load_npz(path):
    with np.load(path) as f:
        if "x" not in f or "y" not in f:
            raise ValueError(f"{path}: needs arrays 'x' and 'y', found {sorted(f.files)}")
        if ("x_test" in f) != ("y_test" in f):
            raise ValueError(f"{path}: held-out data needs both x_test and y_test, or neither")
        x, y = f["x"].astype(np.float32), f["y"].astype(np.int64)
        x_test = f["x_test"].astype(np.float32) if "x_test" in f else x
        y_test = f["y_test"].astype(np.int64) if "y_test" in f else y
    if x.ndim != 2 or y.shape != (len(x),):
        raise ValueError(f"{path}: x must be 2-D and y 1-D of the same length, got {x.shape}, {y.shape}")
    return Dataset(x, y, x_test, y_test)


class BatchOrder:
    """Which rows form global batch ``step``, and which of them are this rank's."""

    def __init__(self, samples, batch_size, world_size, seed):
        if batch_size > samples:
            raise ValueError(f"--batch-size {batch_size} exceeds the {samples} training samples")
        if batch_size % world_size:
            raise ValueError(f"--batch-size {batch_size} does not divide by the world size {world_size}")
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
        per_rank = self.batch_size // self.world_size
        return self.global_rows(step)[rank * per_rank:(rank + 1) * per_rank]
