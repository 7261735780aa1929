"""Text for the GPT: a real corpus every machine has without a download, or sequences from a
file.

- **Default**: the Python standard library's own source files (``*.py`` directly in the
  ``stdlib`` directory, sorted by name), read as bytes, vocabulary 256. The first 90% of the
  bytes are for training and the last 10% are held out. Sequences are consecutive,
  non-overlapping windows of ``T + 1`` bytes: ``x`` the first T, ``y`` the next T (the
  next-byte targets).
- ``--data FILE.npz``: integer arrays ``x`` and ``y`` of shape ``(n, T)`` (optional
  ``x_test``/``y_test``; else the training arrays are also the held-out ones).

The **unigram entropy** of the training bytes, ``−Σ p log2 p``, is what a model that ignores
context would reach in bits per character; a GPT that uses context falls well below it.

>>> corpus = stdlib_corpus(seq_len=64)
>>> corpus.x.shape[1], corpus.unigram_bits < 8
(64, True)
"""
import math
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

DEFAULT_BYTES = 2 << 20   # enough text for a few thousand steps of a small GPT
HELD_OUT = 0.1


@dataclass
class Corpus:
    x: np.ndarray           # (n, T) int64 tokens
    y: np.ndarray           # (n, T) next tokens
    x_test: np.ndarray
    y_test: np.ndarray
    unigram_bits: float     # entropy of the training tokens' frequencies, bits per token
    source: str


def windows(tokens, seq_len):
    """(x, y) of the non-overlapping windows of ``seq_len + 1`` tokens."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens are too few for one sequence of {seq_len}")
    usable = tokens[:n * seq_len + 1]
    return usable[:-1].reshape(n, seq_len).copy(), usable[1:].reshape(n, seq_len).copy()


def unigram_bits(tokens, vocab=256):
    counts = np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def stdlib_text(max_bytes=DEFAULT_BYTES):
    """Bytes of the standard library's top-level source files, in name order."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    parts, total = [], 0
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes], root


def stdlib_corpus(seq_len, max_bytes=DEFAULT_BYTES):
    text, root = stdlib_text(max_bytes)
    tokens = np.frombuffer(text, np.uint8).astype(np.int64)
    cut = int(len(tokens) * (1 - HELD_OUT))
    x, y = windows(tokens[:cut], seq_len)
    x_test, y_test = windows(tokens[cut:], seq_len)
    return Corpus(x, y, x_test, y_test, unigram_bits(tokens[:cut]), f"{root}/*.py ({len(text)} bytes)")


def load_npz(path, seq_len, vocab):
    with np.load(path) as f:
        if "x" not in f or "y" not in f:
            raise ValueError(f"{path}: needs integer arrays 'x' and 'y', found {sorted(f.files)}")
        arrays = {k: f[k] for k in ("x", "y", "x_test", "y_test") if k in f}
    for name, a in arrays.items():
        if a.ndim != 2 or a.shape[1] != seq_len or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{path}: {name} must be integers of shape (n, --seq-len {seq_len}), "
                             f"got {a.dtype} {a.shape}")
        if a.size and (a.min() < 0 or a.max() >= vocab):
            raise ValueError(f"{path}: {name} has tokens outside [0, --vocab {vocab})")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ValueError(f"{path}: held-out data needs both x_test and y_test, or neither")
    for a, b in (("x", "y"), ("x_test", "y_test")):
        if a in arrays and arrays[a].shape != arrays[b].shape:
            raise ValueError(f"{path}: {a} {arrays[a].shape} and {b} {arrays[b].shape} differ in shape")
    x, y = arrays["x"].astype(np.int64), arrays["y"].astype(np.int64)
    x_test = arrays.get("x_test", x).astype(np.int64)
    y_test = arrays.get("y_test", y).astype(np.int64)
    return Corpus(x, y, x_test, y_test, unigram_bits(y, vocab), path)


def bits(nats):
    return nats / math.log(2)
