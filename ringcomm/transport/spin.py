"""How a rank waits for a peer of its host before it sleeps: it spins while every rank has a
core of its own, and yields its core between looks when ranks outnumber the cores, where two
ranks on one core spinning for each other would burn each other's time slices.

The channel (:mod:`.channel`) and a transport's channels together
(:class:`~.peer_channels.PeerChannels`) wait this way, then sleep on their bells.

>>> spin = default_spin(ranks_on_host=2)   # SPIN on two cores or more, else 0.0 (yield)
>>> spin_until(channel.ready, spin)        # rank 1: True once rank 0's message is in
"""
import os
import time

YIELD_BUDGET = 200e-6   # how long a waiter on an oversubscribed host yields before sleeping
# how long a waiter with a core of its own spins before sleeping: long enough to cover the
# skew between two ranks entering one small collective (bench/peers.py, N = 2: 4 KiB 37-45 µs
# and 1.0-1.1x spread between rounds with 300 µs, 39-85 µs and 2-6x with 50 µs), short enough
# that a rank waiting for a slow peer soon leaves its core and the GIL to others
SPIN = 300e-6


def default_spin(ranks_on_host):
    """How long a waiter spins before sleeping: ``SPIN`` while every rank has a core of its
    own, none when ranks outnumber the cores this process may run on (then it yields)."""
    cores = len(os.sched_getaffinity(0))
    return SPIN if ranks_on_host <= cores else 0.0


def spin_until(ready, spin):
    """Whether ``ready()`` came true within ``spin`` seconds of looking (with ``spin`` 0:
    within ``YIELD_BUDGET`` seconds, giving the core away between looks, since the rank
    waited for may be the one that needs it)."""
    budget, pause = (spin, None) if spin else (YIELD_BUDGET, os.sched_yield)
    stop = time.perf_counter() + budget
    while True:
        if ready():
            return True
        if time.perf_counter() >= stop:
            return False
        if pause is not None:
            pause()
