"""A rank's shared-memory channels to and from its same-host peers (:mod:`.channel`), for a
transport that also waits on sockets: it spins on every inbound channel at once
(:meth:`PeerChannels.wait_briefly`), then marks them all dozing and sleeps in one poll of its
sockets and the channels' bells (those :meth:`PeerChannels.open` returns).
"""
import contextlib
import os

from ..errors import FrameError
from .channel import CAPACITY, Channel
from .spin import default_spin, spin_until


class PeerChannels:
    """A rank's channels to and from its same-host peers: the ones it creates (one to each
    peer, :meth:`create`) and the ones it opens (each peer's into it, :meth:`open`), all of
    ``capacity`` ring bytes.

    >>> # rank 0, sharing its host with rank 1 (which does the same with the roles swapped)
    >>> channels = PeerChannels(ranks_on_host=2)
    >>> out = channels.create(1, path_0_to_1)   # at start-up, this rank's end to rank 1
    >>> bell = channels.open(1, path_1_to_0)    # rank 1's channel into this rank: poll bell
    >>> out.try_send(header, payload)           # a Channel's method; False: full
    >>> if not channels.wait_briefly(): ...     # nothing came: sleep in the poll, then awake()
    >>> for src, message in channels.messages(): ...
    """

    def __init__(self, ranks_on_host, capacity=CAPACITY):
        self.capacity, self.spin = capacity, default_spin(ranks_on_host)
        self._out, self._in, self._paths = {}, {}, []
        self._in_list = ()  # the channels into this rank, for the spin's quick look
        self.broken = {}  # peer -> why its channel into this rank is no longer read
        self._dropped = []  # broken channels not closed yet (see close_dropped)

    def create(self, peer, path):
        """Create this rank's channel to ``peer``; returns it (its sender end)."""
        channel = self._out[peer] = Channel.create(path, self.capacity, self.spin)
        self._paths += [path, path + "-bell"]  # only names this rank made: close() unlinks them
        return channel

    def open(self, peer, path):
        """Open ``peer``'s channel into this rank; returns its bell's file descriptor."""
        channel = self._in[peer] = Channel.open(path, self.capacity, self.spin)
        self._in_list = tuple(self._in.values())
        return channel.bell

    def close_dropped(self):
        """Close the channels :meth:`messages` stopped reading (call once their bells are
        out of every poll)."""
        for channel in self._dropped:
            channel.close()
        self._dropped = []

    def messages(self, only=None):
        """Every waiting message (from ``only``, or from every peer), as ``(src, bytes)``: a
        copy, each released from its channel before it is handed out, so that nothing the
        caller does with it can hold or release the channel twice."""
        for src, channel in list(self._in.items()) if only is None else [(only, self._in.get(only))]:
            if channel is None:
                continue
            while True:
                try:
                    message = channel.take()
                except FrameError as exc:  # nothing more is read from it: that peer's data times out
                    self.broken[src] = str(exc)
                    channel.doze(False)  # and its sender rings no more
                    self._dropped.append(channel)  # closed once its bell has left the poll
                    del self._in[src]
                    self._in_list = tuple(self._in.values())
                    break
                if message is None:
                    break
                yield src, message

    def ready(self):
        # a loop, not any(): this runs between the spins of a hot wait
        for channel in self._in_list:  # noqa: SIM110
            if channel._head.value != channel._tail.value:  # Channel.ready, without a call each
                return True
        return False

    def wait_briefly(self, eager=True):
        """Spin up to the spin budget for a message (not ``eager``: yield instead, as on an
        oversubscribed host): True if one came; else False, with every channel marked
        dozing (its sender rings the bell; undo with :meth:`awake`)."""
        if not self._in_list:
            return False
        if spin_until(self.ready, self.spin if eager else 0.0):
            return True
        for channel in self._in_list:
            channel.doze()
        if self.ready():  # came between the last look and the flags
            self.awake()
            return True
        return False

    def awake(self):
        for channel in self._in_list:
            channel.doze(False)

    def forget_bells(self):
        """In a child forked from this process: close its copies of every bell, so that a
        rank that dies hangs its bells up whatever its child does (see :mod:`.liveness`)."""
        for channel in (*self._out.values(), *self._in.values(), *self._dropped):
            if channel.bell >= 0:
                with contextlib.suppress(OSError):
                    os.close(channel.bell)
                channel.bell = -1

    def close(self):
        for path in self._paths:  # a peer that never opened its channel leaves the names
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for channel in (*self._out.values(), *self._in.values()):
            channel.close()
        self.close_dropped()
