"""The host device: numpy arrays in CPU memory, nothing to stage (segments go out
zero-copy), and no stream order to keep. Its methods are the device contract every device
of :mod:`ringcomm.device` keeps.

>>> dev = HostDevice(); dev.activate()
>>> dev.ready() is None and dev.done() is None     # nothing to order on the host
True
"""
import contextlib

import numpy as np


class HostDevice:
    kind = "cpu"
    xp = np
    staged = False

    def is_array(self, x):
        return isinstance(x, np.ndarray)

    def activate(self):
        """Make this the current device of the calling thread (before each collective)."""

    # -- stream order (a GPU's; nothing to order on the host) ---------------------------------
    def ready(self):
        """On the submitting thread: what the collective's device work must follow (None)."""
        return None

    def running(self, ready):
        """Context in which the thread that runs a collective queues its device work."""
        self.activate()
        return contextlib.nullcontext()

    def done(self):
        """After the collective's last device work: its completion event (None)."""
        return None

    def join(self, done, synchronize=False):
        """On the waiting thread: order what it does next after ``done`` (see the module)."""
