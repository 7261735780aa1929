"""An in-process transport: ranks are threads of one process, messages go through queues.

For unit tests of the algorithms layer only; under a :class:`ringcomm.session.Session` it
goes through the same framing, mailbox and wait logic as the ZeroMQ transport, and copies every payload (as a socket would) so an
algorithm that reuses a buffer too early is caught. ``hub.log`` records every message
``(src, dst, key, nbytes, kind)`` so tests can assert the *structure* of a schedule.

>>> hub = LocalHub(2); t0, t1 = Session(hub.transport(0)), Session(hub.transport(1))
>>> hub = LocalHub(4, hosts=[0, 0, 1, 1])  # ranks 0, 1 on one "host", 2, 3 on another
"""
import queue
import threading

from . import frame
from .base import Transport


class LocalHub:
    def __init__(self, world_size, hosts=None):
        self.world_size = world_size
        self.hosts = tuple(hosts) if hosts is not None else (0,) * world_size  # rank -> host
        self.queues = [queue.Queue() for _ in range(world_size)]
        self.log = []
        self._lock = threading.Lock()

    def transport(self, rank):
        return LocalTransport(rank, self)


class LocalTransport(Transport):
    def __init__(self, rank, hub):
        super().__init__(rank, hub.world_size)
        self.hub = hub
        self.host_ids = hub.hosts

    def post(self, dst, header, payload, copy=False):
        data = bytes(memoryview(payload).cast("B")) if not isinstance(payload, bytes) else payload
        hdr = frame.HEADER.unpack(header)
        with self.hub._lock:
            self.hub.log.append((self.rank, dst, frame.Key(hdr[5], frame.Space(hdr[3]), hdr[6], hdr[7], hdr[8]),
                                 len(data), frame.Kind(hdr[2])))
        self.hub.queues[dst].put((header, data))

    def pump(self, timeout):
        try:
            header, data = self.hub.queues[self.rank].get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self.deliver(frame.unpack(header, len(data), self.world_size, self.rank), data)
            try:
                header, data = self.hub.queues[self.rank].get_nowait()
            except queue.Empty:
                return
