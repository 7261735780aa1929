"""What the ZeroMQ transport does with the peers that share its host: shared-memory lanes
for large segments (:mod:`.shm`) and channels for every small message (:mod:`.channel`),
opened at start-up and read while the transport waits.

:class:`SameHost` owns them; :class:`~.zmq_transport.ZmqTransport` makes one and calls it,
and keeps ZeroMQ, the waiting and the mailbox to itself. The peers are those the rendezvous
found on this host seeing the same ``/dev/shm`` (a :class:`LanePlan` names them; with no
plan, a :class:`SameHost` holds nothing and the transport sends everything through ZeroMQ).

To such a peer, every message under the plan's ``channel_max_bytes`` and every slot notice
travels through the channel to that peer, not through ZeroMQ; larger segments, up to one
slot, through the lane, the receiver reducing straight out of the slot (where the channel
cannot run, lanes take segments from ``SHM_MIN_BYTES`` up; see :attr:`SameHost.limits`).
Whatever finds its channel or lane full goes through ZeroMQ. A sender that finds the peer
asleep writes a byte to the channel's bell, which sits in the receiver's poll. BYE and LANE
stay on ZeroMQ (``VIA_ZMQ``), a BYE behind any data sent there, and the receiver empties the
sender's channel before it takes a BYE in.
"""
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from ..errors import CommError, CommTimeout, FrameError, PeerLost
from . import frame
from .channel import hush, largest_message, supported as channel_supported
from .frame import Kind
from .peer_channels import PeerChannels
from .shm import SHM_DIR, InLanes, OutLane, lane_path

log = logging.getLogger(__name__)
VIA_ZMQ = (Kind.BYE, Kind.LANE)  # kinds that never go through a channel
# Segments at least this large go through a shared-memory lane to same-host peers; below
# it a ZeroMQ copy costs less than the slot bookkeeping.
SHM_MIN_BYTES = int(os.environ.get("RINGCOMM_SHM_MIN_BYTES", 32 << 10))


@dataclass
class LanePlan:
    """Which peers this rank exchanges segments with through shared memory, and how."""

    slots: int
    slot_bytes: int
    token: str   # this rank's lane-name token, published in the rendezvous table
    peers: dict  # peer -> that peer's token
    channel_max_bytes: int  # messages below this go through a channel (if there are any)


class SameHost:
    """Owns this rank's shared memory with the peers of its host, as ``plan`` (a
    :class:`LanePlan`, or ``None``: none) says: the lanes out (``out_lanes``, peer ->
    :class:`~.shm.OutLane`) and in (``in_lanes``, an :class:`~.shm.InLanes`), the channels
    (``channels``, a :class:`~.peer_channels.PeerChannels`, or ``None`` where the channel
    cannot run; ``channel_to``, peer -> the channel this rank sends to it through) and their
    bells (``bells``, file descriptor -> the peer whose channel rings it).

    The transport's send path reads ``limits``, ``channel_to`` and ``out_lanes`` directly (a
    dict lookup per message, no call) and its wait spins on ``channels``. What arrives
    through a channel goes to ``file(header, payload)`` (the attribute ``file``: the
    transport points it at its owner's ``deliver`` once it has one, so that a record goes
    from the channel to the mailbox in one call; never a BYE or a LANE, which a channel
    does not carry); a frame refused is counted in
    ``rejected`` and logged. ``bells_changed()`` is called whenever ``bells`` gains or loses
    one, for the transport to rebuild its poll.

    >>> # rank 0, sharing its host with rank 1; rank 1 does the same with the roles swapped
    >>> same_host = SameHost(rank=0, world_size=2, plan=plan, file=transport._file,
    ...                      bells_changed=transport._repoll)
    >>> same_host.create(1)            # then a LANE message to rank 1, through ZeroMQ
    >>> same_host.map_lane(1)          # rank 1's LANE came: its bell is in the poll now
    >>> same_host.channel_to[1].try_send(header, payload)  # False: full, use ZeroMQ
    >>> same_host.drain()              # rank 1's messages, each to file(header, payload)
    """

    def __init__(self, *, rank, world_size, plan, file, bells_changed):
        self.rank, self.world_size, self.plan = rank, world_size, plan
        self.file, self._bells_changed = file, bells_changed
        self.out_lanes = {}  # peer -> OutLane
        self.in_lanes = InLanes(plan.slots, plan.slot_bytes) if plan else None
        self._mapped = set()     # peers whose lane into this rank is mapped
        self._lane_errors = {}   # peer -> why its lane could not be mapped
        self.channels = PeerChannels(len(plan.peers) + 1) if plan and channel_supported() else None
        self.channel_to = {}  # peer -> the channel this rank sends to it through
        self.bells = {}  # bell file descriptor -> the peer whose channel it belongs to
        self.rejected = 0  # frames from a channel refused (see drain)
        # per space (collective, point-to-point): payloads below the first number go through
        # a channel (under the plan's channel_max_bytes, and small enough to fit one with
        # their header however that is set); lanes take segments from the second up; ZeroMQ
        # whatever falls between, or when a lane or channel is full. Point-to-point data may
        # wait long for its receive (a pipeline neighbour runs ahead): in a lane slot it waits
        # where it landed, out of a channel it would be copied into the receiver's heap as
        # soon as the receiver looks, so it keeps lanes from SHM_MIN_BYTES.
        inline_below = 0 if self.channels is None else \
            min(plan.channel_max_bytes, largest_message(self.channels.capacity) - frame.HEADER.size + 1)
        self.limits = ((inline_below, max(SHM_MIN_BYTES, inline_below)),
                       (min(inline_below, SHM_MIN_BYTES), SHM_MIN_BYTES))

    @property
    def peers(self):
        """The global ranks this rank exchanges segments with through shared memory."""
        return frozenset(self.out_lanes)

    # -- opening ---------------------------------------------------------------------------
    def create(self, peer):
        """Create this rank's lane (and channel) to ``peer``, for it to map once told (a LANE
        message). Raises :class:`CommError` when the shared memory cannot be made."""
        plan = self.plan
        try:
            path = lane_path(SHM_DIR, plan.token, self.rank, peer)
            self.out_lanes[peer] = OutLane(path, plan.slots, plan.slot_bytes)
            if self.channels is not None:
                self.channel_to[peer] = self.channels.create(peer, path + "-channel")
        except OSError as exc:
            raise CommError(f"rank {self.rank} cannot create shared memory for rank {peer} in "
                            f"{SHM_DIR}: {exc} (RINGCOMM_SHM=0 sends everything through ZeroMQ)") from None

    def map_lane(self, src):
        """A LANE message from ``src`` arrived: map its lane now, before any notice behind it
        (a failure is raised by :meth:`mapped`). Raises :class:`FrameError` for a LANE
        that was not expected."""
        plan = self.plan
        if plan is None or src not in plan.peers or src in self._mapped:
            raise FrameError(f"unexpected LANE from rank {src}")
        try:
            path = lane_path(SHM_DIR, plan.peers[src], src, self.rank)
            self.in_lanes.open(src, path)
            if self.channels is not None:
                self.bells[self.channels.open(src, path + "-channel")] = src
                self._bells_changed()
            self._mapped.add(src)
        except (OSError, ValueError) as exc:
            self._lane_errors[src] = exc

    def mapped(self, deadline, said_bye):
        """True once every peer's lane into this rank is mapped; False while some are not.
        Raises :class:`CommError` naming the peer whose lane could not be mapped,
        :class:`PeerLost` for one that closed (it is in ``said_bye``) before announcing its
        lane, :class:`CommTimeout` once ``deadline`` passed."""
        if self._lane_errors:
            peer, exc = next(iter(self._lane_errors.items()))
            raise CommError(f"rank {self.rank} cannot map rank {peer}'s shared memory: {exc} "
                            f"(RINGCOMM_SHM=0 sends everything through ZeroMQ)")
        missing = set(self.plan.peers) - self._mapped if self.plan else set()
        if not missing:
            return True
        gone = missing & said_bye
        if gone:
            raise PeerLost(f"rank {self.rank}: rank {min(gone)} closed before announcing its "
                           f"shared memory (its start-up failed)", rank=min(gone))
        if time.monotonic() > deadline:
            raise CommTimeout(f"rank {self.rank}: ranks {sorted(missing)} never announced their "
                              f"shared memory")
        return False

    # -- slots a device fills and reads directly (Transport.take_slot) ----------------------
    def take_slot(self, dst, key, nbytes):
        """A free slot of the lane to ``dst`` for a segment that would go through it, or
        ``None``."""
        lane = self.out_lanes.get(dst)
        if lane is None or not self.limits[key.space][1] <= nbytes <= lane.slot_bytes:
            return None
        return lane.take_slot()

    def notice(self, dst, slot):
        """The notice for the segment written into ``slot`` of the lane to ``dst``."""
        return self.out_lanes[dst].notice(slot)

    def give_back_slot(self, dst, slot):
        self.out_lanes[dst].give_back(slot)

    def segment(self, src, notice, nbytes):
        """The read-only array over the slot that ``src``'s notice names (:class:`FrameError`
        for a bad one)."""
        return self.in_lanes.take(src, bytes(notice), nbytes)

    def slot_of(self, payload):
        """The whole slot a received ``payload`` lies in, or ``None`` (a ZeroMQ frame)."""
        if self.in_lanes is None or not isinstance(payload, np.ndarray):
            return None
        return self.in_lanes.slot_of(payload)

    # -- receiving -------------------------------------------------------------------------
    def drain(self, only=None):
        """File every message waiting in the channels from same-host peers (from ``only``)."""
        channels = self.channels
        if only is None and not channels.ready():
            return
        size = frame.HEADER.size
        broken = len(channels.broken)
        file = self.file
        for src, message in channels.messages(only):
            try:
                header = frame.unpack(message[:size], len(message) - size, self.world_size, self.rank)
                if header.src != src or header.kind in VIA_ZMQ:
                    raise FrameError(f"a {header.kind.name} from rank {header.src} in rank {src}'s channel")
                payload = memoryview(message)[size:]
                if header.kind == Kind.SHM:
                    payload = self.in_lanes.take(src, bytes(payload), header.nbytes)
            except FrameError as exc:
                self.rejected += 1
                log.warning("rank %d rejected a frame: %s", self.rank, exc)
                continue
            file(header, payload)
        if len(channels.broken) > broken:  # a peer that breaks its channel's format: data lost
            self.rejected += 1
            log.error("rank %d stops reading a channel: %s", self.rank, channels.broken)
            self._drop_bells({bell for bell, peer in self.bells.items() if peer in channels.broken})
            channels.close_dropped()

    def on_bell(self, bell):
        """A channel's bell woke the poll (its messages are read right after); a bell whose
        sender closed it (the peer ended) leaves the poll, or it would wake it forever."""
        if not hush(bell):
            self._drop_bells({bell})

    def _drop_bells(self, bells):
        """Take ``bells`` out of the poll (their channels are read no more, or their senders
        are gone)."""
        for bell in bells:
            del self.bells[bell]
        self._bells_changed()

    # -- closing ---------------------------------------------------------------------------
    def forget_bells(self):
        """In a child forked from this rank: close its copies of the bells (see
        :mod:`.liveness`)."""
        if self.channels is not None:
            self.channels.forget_bells()

    def close(self):
        """Unmap every lane and channel (and unlink the names no peer opened)."""
        for lane in self.out_lanes.values():
            lane.close()
        if self.channels is not None:
            self.channels.close()
        if self.in_lanes is not None:
            self.in_lanes.close()
