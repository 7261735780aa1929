"""Which ranks of a group share a host.

Words used by the hierarchical schedules (:mod:`ringcomm.algorithms.hier`) and the traffic
counts (:class:`ringcomm.link.Stats`):

- **host**: the ranks that share one machine (one kernel, network and mount namespace:
  :func:`ringcomm.transport.rendezvous.host_id`). Hosts are numbered 0, 1, … in the order
  of their lowest group rank, so every rank of a group numbers them alike.
- **local rank**: a rank's place among the ranks of its host, in group-rank order.
- **rail** i: the ranks with local rank i, one per host. With L ranks on every host there
  are L rails; each rail's ranks talk across hosts, each over its own link where every rank
  has a network link of its own (a GPU with its own NIC).

>>> t = Topology.of(["a", "a", "b", "b"], rank=2)
>>> t.hosts, t.host_ranks, t.per_host, t.rail(1)
((0, 0, 1, 1), ((0, 1), (2, 3)), 2, (1, 3))
"""
from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Topology:
    hosts: tuple  # group rank -> host number
    rank: int     # this process's group rank

    @classmethod
    def of(cls, host_ids, rank):
        """The topology of a group whose rank r runs on the host named ``host_ids[r]``."""
        numbers = {}
        return cls(tuple(numbers.setdefault(h, len(numbers)) for h in host_ids), rank)

    @cached_property
    def host_ranks(self):
        """For each host, its members' group ranks in order."""
        members = [[] for _ in range(max(self.hosts, default=-1) + 1)]
        for r, h in enumerate(self.hosts):
            members[h].append(r)
        return tuple(tuple(m) for m in members)

    @property
    def num_hosts(self):
        return len(self.host_ranks)

    @cached_property
    def per_host(self):
        """L, the number of ranks on every host; ``None`` when hosts hold different numbers."""
        counts = {len(m) for m in self.host_ranks}
        return counts.pop() if len(counts) == 1 else None

    @cached_property
    def layered(self):
        """True when the group spans several hosts and some host holds more than one rank:
        then a schedule that keeps to the host before it crosses the network pays off."""
        return self.num_hosts > 1 and max(len(m) for m in self.host_ranks) > 1

    def local_rank(self, r):
        return self.host_ranks[self.hosts[r]].index(r)

    @cached_property
    def my_host(self):
        """The group ranks of this rank's host, in order."""
        return self.host_ranks[self.hosts[self.rank]]

    @cached_property
    def by_rail(self):
        """With L ranks on every host: for each group rank g, the place of its chunk in a
        buffer ordered by rail — rail i's H chunks in host order form piece i+1 (mod L),
        the piece local rank i finishes in a ring reduce-scatter inside its host."""
        L, H = self.per_host, self.num_hosts
        slot = [0] * len(self.hosts)
        for h, members in enumerate(self.host_ranks):
            for i, g in enumerate(members):
                slot[g] = ((i + 1) % L) * H + h
        return np.array(slot)

    def rail(self, i):
        """The group ranks with local rank ``i``, in host order (uniform hosts only)."""
        return tuple(m[i] for m in self.host_ranks)

    @cached_property
    def remote(self):
        """For each group rank, whether it runs on another host than this rank; ``None``
        when the whole group shares one host (nothing crosses a network)."""
        if self.num_hosts == 1:
            return None
        mine = self.hosts[self.rank]
        return tuple(h != mine for h in self.hosts)
