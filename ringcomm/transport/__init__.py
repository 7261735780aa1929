"""Transports: how bytes move between ranks. See :mod:`.base` for the interface,
:mod:`.zmq_transport` for the real one, :mod:`.local` for unit tests."""
import zmq

from . import rendezvous
from .zmq_transport import ZmqTransport


def connect(info):
    """Bind this rank's socket, meet every rank through rank 0, connect to all of them.

    ``info`` is a :class:`ringcomm.env.JobInfo`. Returns a :class:`ZmqTransport`.
    """
    context = zmq.Context()
    pull = None
    try:
        pull, entry = rendezvous.bind_pull(context, info.master_addr, info.segment_bytes + 8192)
        settings = {"segment_bytes": info.segment_bytes}
        table = rendezvous.exchange(context, info.rank, info.world_size, info.master_addr,
                                    info.master_port, entry, settings, info.secret, info.timeout)
        endpoints = rendezvous.endpoints_for(entry, table, info.force_tcp)
        return ZmqTransport(info.rank, info.world_size, context, pull, endpoints,
                            cleanup=[entry["ipc"][len("ipc://"):]])
    except BaseException:
        if pull is not None:
            pull.close(0)
        context.destroy(0)
        raise
