"""Agreement on which members of a communicator are lost: every member that decides decides
the same value, even when more members die while they agree (what ``shrink`` rests on).

Terms, used exactly below:

- *members*: the communicator's global ranks. A member is *lost* to this rank once this rank
  has evidence of its end: its process ended (definite, for a member on this host), it
  said goodbye, or its connection dropped for longer than a grace (on another host the only
  evidence there is: a network partition that long would be taken for a death); never a
  guess from silence (see :mod:`ringcomm.transport.connections`). Evidence that another
  member reports is taken as it is.
- a *value*: ``Value(flag, lost)``, the AND of the members' flags and the union of the lost
  members they know of.
- a *round* is led by its *coordinator*: the lowest member not known lost. A round is named
  by its coordinator's rank, so a later round has a higher name.

One round, five messages:

========  =======================  ==========================================================
COLLECT   coordinator → members    what is your state? (to every member it does not know lost)
STATE     member → coordinator     once it has entered: its flag, the members it knows lost,
                                   the value it locked (and the round that proposed it), or
                                   the value it decided
PROPOSE   coordinator → members    once every member answered or is lost: a decided value if
                                   any member reports one, else the one locked in the latest
                                   round, else the AND of the flags and the union of the lost
ACK       member → coordinator     locked
COMMIT    coordinator → members    once every member acked or is lost: decide
========  =======================  ==========================================================

A member whose coordinator is found lost moves on to the next round, whose coordinator
collects again. Why every decision is the same: a COMMIT follows the ACKs of every member
not lost, so once any member decides, every surviving member holds that value locked, and
every later coordinator proposes it again. That rests on the evidence being definite (a
member declared lost has ended): the failure detector the agreement of MPI's fault-tolerance
interface assumes too. A member ignores PROPOSEs of rounds earlier than a COLLECT it
answered, and one that decided still answers later rounds from its decision (it never acks
another value), and still leads one if every lower member is lost (:attr:`Agreement.idle`
says when it has nothing left to do).

Cost: with no member lost on the way, 5(n−1) messages of ``body_bytes(world_size)`` bytes
(the lowest member's two round trips and its COMMIT); each coordinator lost adds a round.

>>> a = Agreement(me=1, members=(0, 1, 2, 3))   # rank 1; rank 2 is lost
>>> a.enter(True, lost={2})                     # [] : rank 0 leads, and asks
>>> a.on_message(0, COLLECT, 0, EMPTY)          # [(0, STATE, 0, Body(...))]
>>> a.on_message(0, PROPOSE, 0, body)           # [(0, ACK, 0, EMPTY)]
>>> a.on_message(0, COMMIT, 0, body)            # [] ; a.decision == Value(True, {2})
"""
import struct
from dataclasses import dataclass

COLLECT, STATE, PROPOSE, ACK, COMMIT = 1, 2, 3, 4, 5
KINDS = {COLLECT: "COLLECT", STATE: "STATE", PROPOSE: "PROPOSE", ACK: "ACK", COMMIT: "COMMIT"}
_HEAD = struct.Struct("<BBBBI")  # flag, decided, has value, value's flag, locked round
_NO_ROUND = 0xFFFFFFFF


@dataclass(frozen=True)
class Value:
    """What the members agree on: the AND of their flags, and which members are lost."""

    flag: bool
    lost: frozenset


@dataclass(frozen=True)
class Body:
    """What an agreement message carries (COLLECT and ACK: nothing of it is read). STATE:
    the sender's ``flag`` and ``known`` lost members, and its locked ``value`` with the
    ``round`` that proposed it, or its decided ``value`` (``decided``); PROPOSE, COMMIT:
    the ``value``."""

    flag: bool = True
    known: frozenset = frozenset()
    value: Value | None = None
    round: int | None = None
    decided: bool = False


EMPTY = Body()


def body_bytes(world_size):
    """The size of every agreement message's body: a head and two bitmaps of the world."""
    return _HEAD.size + 2 * ((world_size + 7) // 8)


def pack(body, world_size):
    """``body`` as bytes (ranks as bitmaps over ``world_size``)."""
    value = body.value
    head = _HEAD.pack(body.flag, body.decided, value is not None, bool(value and value.flag),
                      _NO_ROUND if body.round is None else body.round)
    return head + _bitmap(body.known, world_size) + _bitmap(value.lost if value else (), world_size)


def unpack(data, world_size, members):
    """The :class:`Body` in ``data``; raises ``ValueError`` for anything another rank's
    honest code could not have sent (a size, a flag or a rank out of place)."""
    data = bytes(data)
    if len(data) != body_bytes(world_size):
        raise ValueError(f"agreement body of {len(data)} bytes, expected {body_bytes(world_size)}")
    flag, decided, has_value, value_flag, round_ = _HEAD.unpack_from(data)
    if max(flag, decided, has_value, value_flag) > 1:
        raise ValueError("agreement body with a flag other than 0 or 1")
    half = (len(data) - _HEAD.size) // 2
    known = _ranks(data[_HEAD.size:_HEAD.size + half], world_size, members)
    lost = _ranks(data[_HEAD.size + half:], world_size, members)
    if (round_ != _NO_ROUND and round_ not in members) or (decided and not has_value):
        raise ValueError(f"agreement body names round {round_} (members {sorted(members)}), decided {decided}")
    value = Value(bool(value_flag), lost) if has_value else None
    return Body(bool(flag), known, value, None if round_ == _NO_ROUND else round_, bool(decided))


def _bitmap(ranks, world_size):
    return sum(1 << r for r in ranks).to_bytes((world_size + 7) // 8, "little")


def _ranks(bits, world_size, members):
    number = int.from_bytes(bits, "little")
    ranks = frozenset(r for r in range(number.bit_length()) if number >> r & 1)
    if any(r >= world_size or r not in members for r in ranks):
        raise ValueError(f"agreement body names ranks {sorted(ranks)} beyond the members {sorted(members)}")
    return ranks


class Agreement:
    """One agreement as member ``me`` of ``members`` (global ranks) takes part in it. No
    input or output of its own: every method returns the messages to send, as ``(dst, kind,
    round, Body)``, and :attr:`decision` is the :class:`Value` once decided."""

    def __init__(self, me, members):
        self.me, self.members = me, tuple(sorted(members))
        if me not in self.members:
            raise ValueError(f"rank {me} is not among the members {self.members}")
        self.entered = False
        self.flag = True
        self.lost = set()      # members known lost (never ``me``)
        self.locked = None     # (round, Value) of the latest PROPOSE accepted
        self.promised = -1     # the latest round whose COLLECT this member answered
        self.decision = None
        self.conflict = None   # a second, different value this member was told to decide
        self._asked = set()    # rounds that asked before this member entered
        # as coordinator of round ``me``: the phase, who is still to answer, what came
        self._phase = None     # None, "collect", "propose", "done"
        self._waiting, self._states, self._value = set(), {}, None

    @property
    def coordinator(self):
        """The member leading the current round, as this member sees it."""
        return next(m for m in self.members if m not in self.lost)

    @property
    def idle(self):
        """True once this member has decided and has no round of its own in progress."""
        return self.decision is not None and self._phase in (None, "done")

    def waiting_for(self):
        """The members this member waits for now (a deadline blames them)."""
        if self._phase in ("collect", "propose"):
            return sorted(self._waiting)
        return [] if self.decision is not None else [self.coordinator]

    def enter(self, flag, lost):
        """This member enters with its ``flag`` and the members it knows ``lost``."""
        self.entered, self.flag = True, bool(flag)
        self.lost |= {m for m in lost if m in self.members and m != self.me}  # told in the answers below
        out = [(c, STATE, c, self._state()) for c in sorted(self._asked) if c not in self.lost]
        self.promised = max([self.promised, *self._asked])
        self._asked.clear()
        return out + self.on_lost(lost)

    def on_lost(self, lost):
        """New evidence: ``lost`` members have ended (members already known are skipped)."""
        new = {m for m in lost if m in self.members and m != self.me} - self.lost
        self.lost |= new
        self._waiting -= new
        return self._progress()

    def on_message(self, src, kind, round_, body):
        """A message from member ``src``; one out of place (another rank's bug or malice,
        never an honest rank's) is ignored."""
        if src == self.me or src not in self.members or kind not in KINDS:
            return []
        if kind == COLLECT and round_ == src:
            if self.decision is None and not self.entered:
                self._asked.add(round_)
                return []
            self.promised = max(self.promised, round_)
            return [(src, STATE, round_, self._state())]
        if kind == PROPOSE and round_ == src and body.value is not None:
            if self.decision is None and (not self.entered or round_ < self.promised):
                return []  # from a round overtaken (its coordinator is lost)
            if self.decision is None:
                self.locked, self.promised = (round_, body.value), round_
            elif body.value != self.decision:
                return []  # a round proposing another value than the decided one: never acked
            return [(src, ACK, round_, EMPTY)]
        if kind == COMMIT and round_ == src and body.value is not None and self.entered:
            self._decide(body.value)
            return []
        if round_ == self.me and src in self._waiting and (
                (kind == STATE and self._phase == "collect") or (kind == ACK and self._phase == "propose")):
            if kind == STATE:
                self._states[src] = body
                self.lost |= {m for m in body.known if m in self.members and m != self.me}
                self._waiting -= self.lost
            self._waiting.discard(src)
            return self._progress()
        return []

    # -- as coordinator -------------------------------------------------------------------
    def _progress(self):
        """Start this member's round once it leads, and move it on as answers come."""
        if not self.entered or self.coordinator != self.me:
            return []
        out = []
        if self._phase is None:
            self._phase, self._states = "collect", {}
            self.promised = max(self.promised, self.me)
            self._waiting = set(self._live_others())
            out += [(m, COLLECT, self.me, EMPTY) for m in sorted(self._waiting)]
        while not self._waiting and self._phase != "done":
            if self._phase == "collect":
                self._value = self._choose()
                self.locked, self._phase = (self.me, self._value), "propose"
                self._waiting = set(self._live_others())
                out += [(m, PROPOSE, self.me, Body(value=self._value)) for m in sorted(self._waiting)]
            else:
                self._decide(self._value)
                self._phase = "done"
                out += [(m, COMMIT, self.me, Body(value=self._value)) for m in self._live_others()]
        return out

    def _choose(self):
        states = [*self._states.values(), self._state()]
        for state in states:
            if state.decided:
                return state.value
        locked = [s for s in states if s.value is not None and s.round is not None]
        if locked:
            return max(locked, key=lambda s: s.round).value
        lost = set(self.lost)
        for state in states:
            lost |= state.known
        return Value(all(s.flag for s in states), frozenset(lost))

    def _live_others(self):
        return [m for m in self.members if m != self.me and m not in self.lost]

    # -- either role ------------------------------------------------------------------------
    def _state(self):
        if self.decision is not None:
            return Body(self.flag, frozenset(self.lost), self.decision, None, True)
        round_, value = self.locked or (None, None)
        return Body(self.flag, frozenset(self.lost), value, round_, False)

    def _decide(self, value):
        if self.decision is None:
            self.decision = value
        elif self.decision != value and self.conflict is None:
            # two values: the evidence was not definite (a member declared lost lived on);
            # the first stands, and the caller refuses to go on with it
            self.conflict = value
