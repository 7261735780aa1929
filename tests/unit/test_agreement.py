"""The agreement on lost members (ringcomm.agreement), without a transport: a simulated
network that delivers every message in a random order, members that enter late, crash at
random points (in the middle of sending a batch too), and a failure detector that tells each
survivor of a crash at a random later moment. Whatever happens, every survivor decides, all
decide the same value, and the value is right."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from ringcomm.agreement import (ACK, COLLECT, COMMIT, EMPTY, PROPOSE, STATE, Agreement, Body, Value,
                                body_bytes, pack, unpack)


class Network:
    """Members of one agreement; ``events``: what may happen next, taken in random order."""

    def __init__(self, n, rng, flags, crash_at):
        self.rng, self.n = rng, n
        self.members = {r: Agreement(r, range(n)) for r in range(n)}
        self.flags = flags
        self.crash_at = crash_at  # rank -> how many of its steps it takes before it crashes
        self.steps = dict.fromkeys(range(n), 0)
        self.crashed = set()
        self.events = [("enter", r) for r in range(n)]
        self.sent = 0

    def step(self, rank, outs):
        """``rank`` produced ``outs``; it may crash now, having sent only some of them."""
        self.steps[rank] += 1
        if self.steps[rank] >= self.crash_at.get(rank, 10**9):
            outs = outs[: self.rng.randint(0, len(outs))]
            self.crash(rank)
        for dst, kind, round_, body in outs:
            self.sent += 1
            self.events.append(("msg", dst, rank, kind, round_, body))

    def crash(self, rank):
        self.crashed.add(rank)
        # the failure detector: every other member learns of it, each at its own moment
        self.events += [("lost", r, rank) for r in range(self.n) if r != rank]

    def run(self):
        for rank, at in self.crash_at.items():
            if at == 0:
                self.crash(rank)
        while self.events:
            event = self.events.pop(self.rng.randrange(len(self.events)))
            rank = event[1]
            if rank in self.crashed:
                continue
            member = self.members[rank]
            if event[0] == "enter":
                self.step(rank, member.enter(self.flags[rank], set()))
            elif event[0] == "lost":
                self.step(rank, member.on_lost({event[2]}))
            else:
                _, dst, src, kind, round_, body = event
                # every message crosses the wire as bytes
                body = unpack(pack(body, self.n), self.n, set(range(self.n)))
                self.step(dst, member.on_message(src, kind, round_, body))
        return {r: m for r, m in self.members.items() if r not in self.crashed}


@settings(max_examples=400, deadline=None)
@given(st.integers(2, 7), st.randoms(use_true_random=False), st.data())
def test_every_survivor_decides_the_same_right_value(n, rng, data):
    flags = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    # up to n-1 members crash, each after a random number of its steps (0: before it starts)
    crashing = data.draw(st.lists(st.integers(0, n - 1), max_size=n - 1, unique=True))
    crash_at = {r: data.draw(st.integers(0, 12)) for r in crashing}
    net = Network(n, rng, flags, crash_at)
    survivors = net.run()
    assert survivors, "one member at least survives"
    decisions = {m.decision for m in survivors.values()}
    assert None not in decisions, {r: m.waiting_for() for r, m in survivors.items()}
    assert len(decisions) == 1, decisions
    assert all(m.conflict is None and m.idle for m in survivors.values())
    value = decisions.pop()
    assert value.lost <= net.crashed  # nobody alive is ever declared lost
    assert {r for r, at in crash_at.items() if at == 0} <= value.lost  # dead from the start: lost
    if not all(flags[r] for r in survivors):
        assert value.flag is False  # every survivor's flag counts
    if value.flag is False:
        assert not all(flags)


def test_no_failure_takes_five_messages_per_other_member():
    net = Network(5, random.Random(0), [True] * 5, {})
    survivors = net.run()
    assert {m.decision for m in survivors.values()} == {Value(True, frozenset())}
    assert net.sent == 5 * 4


def test_a_member_that_decided_leads_when_every_lower_one_is_lost():
    """Rank 0 commits to rank 1 alone and dies: rank 1 has decided, yet ranks 2 and 3 still
    wait; rank 1 must lead the next round from its decision, or they wait forever."""
    members = {r: Agreement(r, range(4)) for r in range(4)}
    out = {r: members[r].enter(True, {3} if r == 0 else set()) for r in range(4)}
    assert [m[:2] for m in out[0]] == [(1, COLLECT), (2, COLLECT)]
    for r in (1, 2):
        [(dst, kind, round_, state)] = members[r].on_message(0, COLLECT, 0, EMPTY)
        proposals = members[0].on_message(r, STATE, 0, state)
    assert [p[:2] for p in proposals] == [(1, PROPOSE), (2, PROPOSE)]
    body = proposals[0][3]
    for r in (1, 2):
        members[0].on_message(r, ACK, 0, members[r].on_message(0, PROPOSE, 0, body)[0][3])
    assert members[0].decision == Value(True, frozenset({3}))
    members[1].on_message(0, COMMIT, 0, body)  # rank 0 dies before its COMMIT reaches rank 2
    assert members[1].idle and members[2].decision is None
    collect = members[1].on_lost({0, 3})  # rank 1 now leads round 1
    assert [c[:3] for c in collect] == [(2, COLLECT, 1)]
    members[2].on_lost({0, 3})
    [(_, _, _, state)] = members[2].on_message(1, COLLECT, 1, EMPTY)
    [(_, _, _, proposal)] = members[1].on_message(2, STATE, 1, state)
    assert proposal.value == Value(True, frozenset({3}))  # the decided value, not {0, 3}
    members[1].on_message(2, ACK, 1, members[2].on_message(1, PROPOSE, 1, proposal)[0][3])
    members[2].on_message(1, COMMIT, 1, proposal)
    assert members[2].decision == members[1].decision == Value(True, frozenset({3}))


def test_a_proposal_of_an_overtaken_round_is_ignored():
    a = Agreement(2, range(3))
    a.enter(True, set())
    a.on_message(1, COLLECT, 1, EMPTY)  # round 1 asked: round 0's proposal comes too late
    assert a.on_message(0, PROPOSE, 0, Body(value=Value(True, frozenset()))) == []
    assert a.locked is None


def test_messages_out_of_place_are_ignored():
    a = Agreement(1, range(3))
    a.enter(True, set())
    value = Body(value=Value(True, frozenset()))
    assert a.on_message(1, COLLECT, 1, EMPTY) == []       # from itself
    assert a.on_message(7, COLLECT, 7, EMPTY) == []       # not a member
    assert a.on_message(0, COLLECT, 2, EMPTY) == []       # a round not its sender's
    assert a.on_message(2, STATE, 1, EMPTY) == []         # a state it never asked for
    assert a.on_message(0, 99, 0, value) == []            # no such kind
    assert a.decision is None


@pytest.mark.parametrize("world", [1, 7, 8, 9, 300])
def test_bodies_round_trip_and_bad_ones_are_refused(world):
    members = set(range(world))
    body = Body(False, frozenset({world - 1}), Value(True, frozenset({0})), 0, True)
    data = pack(body, world)
    assert len(data) == body_bytes(world) and unpack(data, world, members) == body
    with pytest.raises(ValueError, match="bytes"):
        unpack(data + b"\0", world, members)
    with pytest.raises(ValueError, match="flag"):
        unpack(b"\x02" + data[1:], world, members)
    with pytest.raises(ValueError, match="beyond"):
        unpack(data, world, members - {0})  # a lost rank that is no member
    if world % 8:
        bad = bytearray(data)
        bad[-1] |= 0x80  # a bit past the world
        with pytest.raises(ValueError, match="beyond"):
            unpack(bytes(bad), world, members)


def test_a_state_with_a_value_but_no_round_does_not_break_the_coordinator():
    """Another rank's bug (or malice): a STATE that carries a locked value without the round
    that proposed it is not a locked value; the coordinator goes on."""
    a = Agreement(0, range(2))
    [(_, kind, _, _)] = a.enter(True, set())
    assert kind == COLLECT
    odd = unpack(pack(Body(True, frozenset(), Value(True, frozenset({1})), None, False), 2), 2, {0, 1})
    out = a.on_message(1, STATE, 0, odd)
    assert [o[1] for o in out] == [PROPOSE] and out[0][3].value == Value(True, frozenset())


def test_a_decided_member_never_acks_another_value():
    a = Agreement(2, range(3))
    a.enter(True, set())
    a.on_message(0, COLLECT, 0, EMPTY)
    a.on_message(0, PROPOSE, 0, Body(value=Value(True, frozenset())))
    a.on_message(0, COMMIT, 0, Body(value=Value(True, frozenset())))
    assert a.on_message(1, PROPOSE, 1, Body(value=Value(True, frozenset({0})))) == []
    assert a.on_message(1, PROPOSE, 1, Body(value=Value(True, frozenset())))[0][1] == ACK


def test_a_member_entering_late_tells_the_losses_it_knows_in_its_first_answer():
    a = Agreement(1, range(3))
    a.on_message(0, COLLECT, 0, EMPTY)  # asked before it entered
    [(_, kind, _, state)] = a.enter(True, {2})
    assert kind == STATE and state.known == frozenset({2})
