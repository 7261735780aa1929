"""What a transport does with the peers that share its host: shared-memory lanes for large
segments (:mod:`.shm`) and channels for every small message (:mod:`.channel`), set up at
start-up and read while the transport waits.

:class:`SameHost` is a part of :class:`~.zmq_transport.ZmqTransport` (its attributes are made
there): opening the lanes and channels to every same-host peer (``open_lanes``, each peer's
LANE announcement mapped by ``_map_lane``), filing what arrives through the channels
(``_drain_channels``), the channels' bells in the transport's poll (``_on_bell``), and the
lane slots a device copies into and out of directly (``take_slot``, ``slot_of``).
"""
import logging
import time
from dataclasses import dataclass

import numpy as np
import zmq

from ..errors import CommError, CommTimeout, FrameError, PeerLost
from . import frame
from .channel import hush
from .frame import Kind
from .shm import SHM_DIR, OutLane, lane_path

log = logging.getLogger(__name__)
VIA_ZMQ = (Kind.BYE, Kind.LANE)  # kinds that never go through a channel (see .zmq_transport)


@dataclass
class LanePlan:
    """Which peers this rank exchanges segments with through shared memory, and how."""

    slots: int
    slot_bytes: int
    token: str   # this rank's lane-name token, published in the rendezvous table
    peers: dict  # peer -> that peer's token
    channel_max_bytes: int  # messages below this go through a channel (if there are any)


class SameHost:
    @property
    def lane_peers(self):
        """The global ranks this rank exchanges segments with through shared memory."""
        return frozenset(self._out_lanes)

    def open_lanes(self, deadline):
        """Create this rank's lanes to its same-host peers, announce them (LANE), and wait
        until every peer's lane into this rank is mapped. Raises :class:`CommError` naming
        the peer when a lane cannot be made or mapped."""
        plan = self._plan
        if plan is None:
            return
        empty = frame.Key(0, frame.COLLECTIVE, 0, 0, 0)
        for peer in plan.peers:
            try:
                path = lane_path(SHM_DIR, plan.token, self.rank, peer)
                self._out_lanes[peer] = OutLane(path, plan.slots, plan.slot_bytes)
                if self._channels is not None:
                    self._channel_to[peer] = self._channels.create(peer, path + "-channel")
            except OSError as exc:
                raise CommError(f"rank {self.rank} cannot create shared memory for rank {peer} in "
                                f"{SHM_DIR}: {exc} (RINGCOMM_SHM=0 sends everything through ZeroMQ)") from None
            self._post(peer, frame.pack(Kind.LANE, self.rank, empty, 0, bytes(16)), b"")
        while len(self._lanes_in) < len(plan.peers):
            if self._lane_errors:
                peer, exc = next(iter(self._lane_errors.items()))
                raise CommError(f"rank {self.rank} cannot map rank {peer}'s shared memory: {exc} "
                                f"(RINGCOMM_SHM=0 sends everything through ZeroMQ)")
            self._check_peers("opening shared-memory lanes")
            gone = (set(plan.peers) - self._lanes_in) & self._said_bye
            if gone:
                raise PeerLost(f"rank {self.rank}: rank {min(gone)} closed before announcing its "
                               f"shared memory (its start-up failed)", rank=min(gone))
            if time.monotonic() > deadline:
                missing = sorted(set(plan.peers) - self._lanes_in)
                raise CommTimeout(f"rank {self.rank}: ranks {missing} never announced their shared memory")
            self._pump(0.05)

    # -- slots a device fills and reads directly (Transport.take_slot) ----------------------
    def take_slot(self, dst, key, nbytes):
        lane = self._out_lanes.get(dst)
        if lane is None or not self._limits[key.space][1] <= nbytes <= lane.slot_bytes:
            return None
        return lane.take_slot()

    def _send_slot(self, dst, key, sig, slot, nbytes):
        try:
            self._check_open_to(dst)
        except BaseException:  # nothing announced: the slot is free again; once the notice
            self._out_lanes[dst].give_back(slot)  # may be out, the receiver frees it
            raise
        notice = self._out_lanes[dst].notice(slot)
        self._post(dst, frame.pack(Kind.SHM, self.rank, key, nbytes, sig), notice, True)

    def give_back_slot(self, dst, slot):
        self._out_lanes[dst].give_back(slot)

    def slot_of(self, payload):
        if self._in_lanes is None or not isinstance(payload, np.ndarray):  # a ZeroMQ frame
            return None
        return self._in_lanes.slot_of(payload)

    def _map_lane(self, src):
        """A LANE message from ``src`` arrived: map its lane now, before any notice behind it."""
        if src not in self._plan.peers or src in self._lanes_in:
            raise FrameError(f"unexpected LANE from rank {src}")
        try:
            path = lane_path(SHM_DIR, self._plan.peers[src], src, self.rank)
            self._in_lanes.open(src, path)
            if self._channels is not None:
                bell = self._channels.open(src, path + "-channel")
                self._bells[bell] = src
                self._poll_all.append((bell, zmq.POLLIN))
            self._lanes_in.add(src)
        except (OSError, ValueError) as exc:
            self._lane_errors[src] = exc

    def _drain_channels(self, only=None):
        """File every message waiting in the channels from same-host peers (from ``only``)."""
        channels = self._channels
        if only is None and not channels.ready():
            return
        size = frame.HEADER.size
        broken = len(channels.broken)
        for src, message in channels.messages(only):
            try:
                header = frame.unpack(message[:size], len(message) - size, self.world_size, self.rank)
                if header.src != src or header.kind in VIA_ZMQ:
                    raise FrameError(f"a {header.kind.name} from rank {header.src} in rank {src}'s channel")
                payload = memoryview(message)[size:]
                if header.kind == Kind.SHM:
                    payload = self._in_lanes.take(src, bytes(payload), header.nbytes)
            except FrameError as exc:
                self.rejected += 1
                log.warning("rank %d rejected a frame: %s", self.rank, exc)
                continue
            self._file(header, payload)
        if len(channels.broken) > broken:  # a peer that breaks its channel's format: data lost
            self.rejected += 1
            log.error("rank %d stops reading a channel: %s", self.rank, channels.broken)
            self._drop_bells({bell for bell, peer in self._bells.items() if peer in channels.broken})
            channels.close_dropped()

    def _on_bell(self, bell):
        """A channel's bell woke the poll (its messages are read right after); a bell whose
        sender closed it (the peer ended) leaves the poll, or it would wake it forever."""
        if not hush(bell):
            self._drop_bells({bell})

    def _drop_bells(self, bells):
        """Take ``bells`` out of the poll (their channels are read no more, or their senders
        are gone)."""
        for bell in bells:
            del self._bells[bell]
        self._poll_all = [item for item in self._poll_all if item[0] not in bells]
