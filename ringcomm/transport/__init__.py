"""Transports: how bytes move between ranks (the wire under :mod:`ringcomm.session`). See
:mod:`.base` for the interface, :mod:`.zmq_transport` for the real one, :mod:`.local` for
unit tests."""
import contextlib
import os
import time

import zmq

from .. import env
from . import liveness, rendezvous
from .credit import P2P_WINDOW_BYTES
from .security import Guard
from .tuning import raise_fd_limit
from . import shm
from .same_host import LanePlan
from .zmq_transport import ZmqTransport


def _shared_memory_entry(info):
    """What this rank tells the others about its /dev/shm (``None``: no lanes)."""
    if not info.shared_memory or info.force_tcp:
        return None
    try:
        return {"id": shm.identity(), "token": shm.new_token()}
    except OSError:  # no /dev/shm here
        return None


def _lane_plan(info, entry, table):
    """Lanes go to every other rank of this host that sees the same /dev/shm as this one."""
    mine = entry["shm"]
    if mine is None:
        return None
    peers = {p: e["shm"].get("token") for p, e in enumerate(table)
             if p != info.rank and e["host"] == entry["host"] and isinstance(e.get("shm"), dict)
             and e["shm"].get("id") == mine["id"]}
    if not peers:
        return None
    return LanePlan(info.shm_slots, info.segment_bytes, mine["token"], peers, info.channel_max_bytes)


def _forget_secret_file(info):
    if info.secret_file:
        with contextlib.suppress(OSError):
            os.unlink(info.secret_file)
        info.secret_file = ""


def connect(info):
    """Bind this rank's socket, meet every rank through rank 0, connect to all of them.

    ``info`` is a :class:`ringcomm.env.JobInfo`. Returns a :class:`ZmqTransport`.
    """
    raise_fd_limit()
    context = zmq.Context()
    pull = guard = None
    try:
        guard = Guard(context, info.secret, info.world_size, info.encrypt)
        need_tcp = info.force_tcp or env.spans_hosts(info)
        pull, entry = rendezvous.bind_pull(context, info.master_addr, info.segment_bytes + 8192,
                                           guard, need_tcp, info.local_rank)
        entry["shm"] = _shared_memory_entry(info)
        settings = {"segment_bytes": info.segment_bytes,
                    "shm_slots": info.shm_slots if info.shared_memory else 0,
                    "p2p_window": P2P_WINDOW_BYTES, "collective_window": info.collective_window}
        table = rendezvous.exchange(context, info.rank, info.world_size, info.master_addr,
                                    info.master_port, entry, settings, info.secret, info.job,
                                    info.timeout)
        _forget_secret_file(info)  # every rank has joined: all of them know the secret
        endpoints = rendezvous.endpoints_for(entry, table, info.force_tcp,
                                             source=rendezvous.source_ip(info.local_rank) if need_tcp else None)
        transport = ZmqTransport(info.rank, info.world_size, context, pull, endpoints,
                                 [e["id"] for e in table], guard=guard,
                                 cleanup=rendezvous.socket_files(entry),
                                 lanes=_lane_plan(info, entry, table),
                                 processes=liveness.watched(info.rank, table),
                                 bound={"ipc": entry["ipc"], "tcp": entry["tcp"], "id": entry["id"]})
        transport.host_ids = tuple(e["host"] for e in table)
        try:
            transport.await_connections(time.monotonic() + info.timeout)
            transport.open_lanes(time.monotonic() + info.timeout)
        except BaseException:
            transport.close()
            raise
        return transport
    except BaseException:
        _forget_secret_file(info)
        if pull is not None:
            pull.close(0)
        if guard is not None:
            guard.stop()
        context.destroy(0)
        raise
