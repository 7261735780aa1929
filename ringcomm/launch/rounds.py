"""Restarts across hosts: the launchers of a several-host job agree on every round.

With ``--nnodes > 1`` and ``--max-restarts K``, node 0's launcher runs a
:class:`Coordinator` on ``MASTER_ADDR:MASTER_PORT`` and every launcher, node 0's too, talks
to it through an :class:`Agent`. A **round** is one attempt of the whole job, numbered from
0; its workers get ``RINGCOMM_RESTART_COUNT`` = the round, which is part of the name they
meet under at their rendezvous (on ``MASTER_PORT + 1``), so a straggler of an earlier round
is refused there.

Round k:

1. every agent says JOIN k; once all ``nnodes`` have, the coordinator answers each with GO
   (the round, the job's name, the workers' port);
2. a launcher whose workers failed says FAILED k, one whose workers all exited 0 says DONE
   k, one that was interrupted (SIGINT, SIGTERM) or could not go on says QUIT k;
3. the first FAILED or QUIT decides the round: every agent gets the VERDICT of round k,
   RESTART (while k < K, and not after a QUIT) or GIVE_UP, and its launcher stops its
   workers; DONE from every node decides FINISHED;
4. after RESTART every launcher joins round k+1 once its workers are stopped (a QUIT that
   comes after a RESTART gives round k+1 the verdict GIVE_UP).

The coordinator sends a heartbeat every second from its own thread; an agent beats whenever
its launcher waits or watches its workers. An agent that has heard the coordinator and
then, while it waits for a GO or a verdict, hears nothing for ``LOST_AFTER_S`` gives up,
saying the coordinator is lost (while its workers run it does not judge: they fail on their
own when node 0 is gone). The coordinator gives the round up when a node it knows is silent
for ``SILENT_NODE_S`` (its launcher died), and when nodes do not join a round within
``join_timeout`` seconds. A second launcher claiming a node that is taken is told so.

Messages: ``MAGIC``, an HMAC-SHA256 under the job secret of the JSON that follows, and the
JSON. An agent opens with HELLO (its own fresh nonce); the coordinator answers with a fresh
nonce for that connection. From then on every message carries the receiver's nonce and a
counter that only grows, so a message recorded from another connection, another job with
the same secret, or earlier in this one is refused; a stranger without the secret can
neither join, stop nor restart the job. Connections that never sent a fresh message are
kept up to ``MAX_CONNECTIONS``, the oldest dropped first, so replayed hellos cannot crowd
out a real launcher. Frames over 64 KiB are refused by ZeroMQ. No pickle.

>>> agent = Agent(node=1, addr="10.0.0.1", port=29500, secret=s, join_timeout=300)
>>> agent.join(0)                 # {'round': 0, 'job': ..., 'port': 29501} once all joined
>>> agent.report("failed", 0); agent.verdict(0)    # ('restart', "node 1's workers failed")
"""
from __future__ import annotations

import json
import secrets
import threading
import time

import zmq

from ..transport.rendezvous import sign, verified

MAGIC = b"RCL2"
HEARTBEAT_S = 1.0
LOST_AFTER_S = 15.0
# a node's launcher is given up after this long unheard: longer than stopping its workers may
# take (failure reports 1.5 s, SIGTERM grace 3 s, kills and reaping up to about 15 s), while
# it beats only between those steps
SILENT_NODE_S = 60.0
CLOSE_DRAIN_S = 0.5  # close() handles what arrived before it for at most this long
MAX_FRAME_BYTES = 64 << 10
MAX_CONNECTIONS = 4096  # hellos remembered (replayed ones cost nothing more beyond this)
RESTART, GIVE_UP, FINISHED = "restart", "give_up", "finished"


class RoundsError(RuntimeError):
    """The launchers could not agree: a node did not come, or the coordinator was lost."""


def _seal(secret: str, doc: dict) -> bytes:
    body = json.dumps(doc, sort_keys=True).encode()
    return MAGIC + sign(secret, body) + body


def _open(secret: str, frame: bytes):
    """The message in ``frame``, or None if it is not one sealed under ``secret``."""
    if len(frame) < 36 or frame[:4] != MAGIC:
        return None
    mac, body = frame[4:36], frame[36:]
    if not verified(secret, mac, body):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    ok = isinstance(doc, dict) and isinstance(doc.get("round"), int) and isinstance(doc.get("n"), int)
    return doc if ok else None


class _Complaints:
    """Logs the first refused message of each kind, then one in a hundred of that kind."""

    def __init__(self, log):
        self.log, self.counts = log, {}

    def __call__(self, what):
        count = self.counts[what] = self.counts.get(what, 0) + 1
        if count == 1 or count % 100 == 0:
            self.log(f"rounds: refused {what} ({count} so far)")


class Coordinator:
    """Node 0's side, in a thread of its own: counts joins, decides each round."""

    def __init__(self, *, nnodes, max_restarts, addr, port, secret, job, worker_port, join_timeout, log):
        self.nnodes, self.max_restarts, self.secret = nnodes, max_restarts, secret
        self.job, self.worker_port, self.join_timeout, self.log = job, worker_port, join_timeout, log
        self._refused = _Complaints(log)
        self._ctx = zmq.Context()
        try:
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 2000)  # the last verdicts still leave after close
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            self._sock.bind(f"tcp://{addr}:{port}")
        except zmq.ZMQError as exc:
            self._ctx.destroy(0)
            raise RoundsError(f"cannot listen for the other nodes' launchers on {addr}:{port}: {exc}") from None
        self._round, self._joined, self._done, self._verdicts = 0, set(), set(), {}
        self._round_opened = time.monotonic()
        self._conns = {}   # ZeroMQ identity -> {"ours", "theirs", "n", "node"}: one agent's connection
        self._peers = {}   # node -> identity of its agent's connection
        self._heard = {}   # node -> when it was last heard
        self._sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ringcomm-launch-rounds", daemon=True)
        self._thread.start()

    def close(self):
        self._stop.set()
        self._thread.join(CLOSE_DRAIN_S + 5)
        if not self._thread.is_alive():  # it closed its socket itself
            self._ctx.term()

    def _send_to(self, ident, doc):
        conn = self._conns[ident]
        self._sent += 1
        body = dict(doc, to=conn["theirs"], n=self._sent)
        self._sock.send_multipart([ident, _seal(self.secret, body)])

    def _send(self, node, doc):
        if node in self._peers:
            self._send_to(self._peers[node], doc)

    def _broadcast(self, doc):
        for node in list(self._peers):
            self._send(node, doc)

    def _serve(self):
        try:
            self._loop()
        finally:
            self._sock.close()  # in this thread: a ZeroMQ socket belongs to one thread

    def _loop(self):
        beat, stop_by = time.monotonic(), None
        while True:
            if self._stop.is_set() and stop_by is None:
                stop_by = time.monotonic() + CLOSE_DRAIN_S
            if stop_by is not None and (time.monotonic() > stop_by or not self._sock.poll(0)):
                return  # what arrived before close is handled, for a bounded time
            if self._sock.poll(0 if stop_by else 100):
                self._receive()
            now = time.monotonic()
            if now - beat >= HEARTBEAT_S:
                beat = now
                self._broadcast({"kind": "beat", "round": self._round})
            if self._round in self._verdicts:
                continue
            if len(self._joined) < self.nnodes and now - self._round_opened > self.join_timeout:
                missing = sorted(set(range(self.nnodes)) - self._joined)
                self._decide(GIVE_UP, f"node(s) {missing} did not join round {self._round} "
                                      f"within {self.join_timeout:g} s")
            silent = sorted(node for node, t in self._heard.items() if now - t > SILENT_NODE_S)
            if silent:
                self._decide(GIVE_UP, f"the launcher of node(s) {silent} stopped answering "
                                      f"for {SILENT_NODE_S:g} s")

    def _receive(self):
        parts = self._sock.recv_multipart()
        if len(parts) != 2:
            return self._refused("a malformed frame")
        ident, frame = parts
        doc = _open(self.secret, frame)
        if doc is None:
            return self._refused("a message not signed with the job secret")
        node = doc.get("node")
        if not isinstance(node, int) or not 0 <= node < self.nnodes:
            return self._refused(f"a message from node {node!r}: --nnodes is {self.nnodes} here")
        if doc.get("kind") == "hello":
            if not isinstance(doc.get("nonce"), str) or ident in self._conns:
                return self._refused("a second hello on one connection")
            if len(self._conns) >= MAX_CONNECTIONS:  # the oldest never-confirmed ones go first
                confirmed = set(self._peers.values())
                for old in [i for i in self._conns if i not in confirmed][:len(self._conns) - MAX_CONNECTIONS + 1]:
                    del self._conns[old]
            self._conns[ident] = {"ours": secrets.token_hex(16), "theirs": doc["nonce"], "n": doc["n"],
                                  "node": node}
            return self._send_to(ident, {"kind": "challenge", "round": self._round, "nonce": self._conns[ident]["ours"]})
        conn = self._conns.get(ident)
        if conn is None or doc.get("to") != conn["ours"] or doc["n"] <= conn["n"] or conn["node"] != node:
            return self._refused("a message that is not fresh for its connection (replayed, or "
                                 "from another connection or job)")
        conn["n"] = doc["n"]
        if self._peers.get(node, ident) != ident:
            self._refused(f"a second launcher claiming node {node}")
            return self._send_to(ident, {"kind": "refused", "round": -1,
                                         "why": f"node {node} already has a launcher in this job"})
        self._peers[node] = ident
        self._heard[node] = time.monotonic()
        self._handle(node, doc)

    def _handle(self, node, doc):
        kind, rnd = doc.get("kind"), doc["round"]
        if kind == "beat" or self._between_rounds(node, kind, rnd):
            return
        if rnd != self._round:
            return  # a message of an earlier round: that round is decided
        if rnd in self._verdicts:  # anything after the verdict: say the verdict again
            return self._send(node, self._verdict_doc(rnd))
        if kind == "join":
            self._joined.add(node)
            if len(self._joined) == self.nnodes:
                self._broadcast({"kind": "go", "round": rnd, "job": self.job, "port": self.worker_port})
        elif kind == "done":
            self._done.add(node)
            if len(self._done) == self.nnodes:
                self._decide(FINISHED, "every node's workers succeeded")
        elif kind in ("failed", "quit"):
            restart = kind == "failed" and rnd < self.max_restarts
            why = f"node {node}'s workers failed" if kind == "failed" else f"node {node}'s launcher quit"
            self._decide(RESTART if restart else GIVE_UP, why)

    def _between_rounds(self, node, kind, rnd):
        """After a RESTART verdict: the first join of the next round opens it, and a quit
        of either round gives the job up (the next round cannot start without that node).
        True if ``kind`` was a quit handled here; a join goes on to be counted."""
        restarting = self._verdicts.get(self._round, (None,))[0] == RESTART
        if kind == "join" and rnd == self._round + 1 and restarting:
            self._round, self._joined, self._done = rnd, set(), set()
            self._round_opened = time.monotonic()
        if kind == "quit" and self._verdicts.get(rnd, (None,))[0] == RESTART and rnd in (self._round, self._round - 1):
            if rnd == self._round:
                self._round, self._joined, self._done = rnd + 1, set(), set()
            if self._round not in self._verdicts:
                self._decide(GIVE_UP, f"node {node}'s launcher quit before round {rnd + 1}")
            return True
        return False

    def _decide(self, verdict, why):
        self._verdicts[self._round] = (verdict, why)
        self._broadcast(self._verdict_doc(self._round))

    def _verdict_doc(self, rnd):
        verdict, why = self._verdicts[rnd]
        return {"kind": "verdict", "round": rnd, "verdict": verdict, "why": why}


class Agent:
    """One launcher's side: join a round, report how it went, hear the verdict."""

    def __init__(self, *, node, addr, port, secret, join_timeout):
        self.node, self.secret, self.join_timeout = node, secret, join_timeout
        self._where = f"{addr}:{port}"
        self._ctx = zmq.Context()
        self._nonce, self._theirs = secrets.token_hex(16), None  # ours; the coordinator's
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # the same identity if the connection is remade (ZeroMQ refuses a second one with it)
        self._sock.setsockopt(zmq.ROUTING_ID, self._nonce.encode())
        try:
            self._sock.connect(f"tcp://{self._where}")
        except zmq.ZMQError as exc:
            self._ctx.destroy(0)
            raise RoundsError(f"cannot reach the coordinating launcher at {self._where}: {exc}") from None
        self._pending = []      # what was said before the coordinator's challenge came
        self._sent, self._got = 0, 0
        self._heard = None      # when the coordinator was last heard (None: not yet)
        self._beat = 0.0        # when this agent last sent anything
        self._verdicts = {}     # round -> (verdict, why)
        self._go = {}           # round -> GO message
        self._refusal = None    # why the coordinator refused this launcher
        self._say("hello", -1, nonce=self._nonce)

    def close(self):
        self._sock.close()
        self._ctx.term()

    def _say(self, kind, rnd, **more):
        self._sent += 1
        doc = dict(more, kind=kind, round=rnd, node=self.node, n=self._sent)
        if self._theirs is not None:
            doc["to"] = self._theirs
        elif kind != "hello":  # before the challenge: said once it has come
            self._pending.append((kind, rnd))
            return
        self._beat = time.monotonic()
        self._sock.send(_seal(self.secret, doc))

    def _take(self, timeout_ms):
        """File whatever the coordinator said within ``timeout_ms``; beat when due."""
        if self._theirs is not None and time.monotonic() - self._beat >= HEARTBEAT_S:
            self._say("beat", -1)
        if not self._sock.poll(timeout_ms):
            return
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            doc = _open(self.secret, frame)
            if doc is None or doc.get("to") != self._nonce or doc["n"] <= self._got:
                continue  # not the coordinator of this connection, or replayed
            self._got = doc["n"]
            self._heard = time.monotonic()
            kind = doc.get("kind")
            if kind == "challenge" and self._theirs is None and isinstance(doc.get("nonce"), str):
                self._theirs = doc["nonce"]
                pending, self._pending = list(self._pending), []
                for said in pending:
                    self._say(*said)
            elif kind == "go":
                self._go[doc["round"]] = doc
            elif kind == "verdict":
                self._verdicts[doc["round"]] = (doc.get("verdict"), doc.get("why", ""))
            elif kind == "refused":
                self._refusal = str(doc.get("why"))

    def _wait(self, done, what, interrupted, first_contact_s):
        """Move messages until ``done()``; raise RoundsError once the coordinator is lost.
        Returns the signal number if ``interrupted()`` says one came, else 0."""
        start = time.monotonic()
        while True:
            self._take(0)  # what is queued first: it may be the answer, and it says who is alive
            if done():
                return 0
            signum = interrupted()
            if signum:
                return signum
            if self._refusal:
                raise RoundsError(f"the coordinating launcher refused this one: {self._refusal}")
            now = time.monotonic()
            if self._heard is None and now - start > first_contact_s:
                raise RoundsError(f"no word from the coordinating launcher (node 0, {self._where}) "
                                  f"within {first_contact_s:g} s, {what}")
            if self._heard is not None and now - self._heard > LOST_AFTER_S:
                raise RoundsError(f"lost the coordinating launcher (node 0, {self._where}): nothing "
                                  f"heard for {LOST_AFTER_S:g} s, {what}")
            self._take(100)

    def join(self, rnd, interrupted=lambda: 0):
        """Wait until every node joined round ``rnd``: its GO (``job``, ``port``), or the
        verdict that ended the job instead (a dict with ``verdict``), or ``{"signal": n}``
        when ``interrupted()`` said so first."""
        self._say("join", rnd)
        signum = self._wait(lambda: rnd in self._go or rnd in self._verdicts, f"waiting to join round {rnd}",
                            interrupted, self.join_timeout + LOST_AFTER_S)
        if signum:
            return {"signal": signum}
        if rnd in self._go:
            return self._go[rnd]
        verdict, why = self._verdicts[rnd]
        return {"verdict": verdict, "why": why}

    def stop_requested(self, rnd):
        """Whether round ``rnd`` was decided elsewhere (non-blocking; beats when due)."""
        self._take(0)
        return rnd in self._verdicts

    def report(self, kind, rnd):
        """Say how round ``rnd`` went here: ``done``, ``failed`` or ``quit``."""
        self._say(kind, rnd)

    def verdict(self, rnd, interrupted=lambda: 0, within=None):
        """Wait for round ``rnd``'s verdict: (verdict, why); ``(None, signal)`` when
        ``interrupted()`` said so first; ``within`` seconds at most when given (then
        ``(None, None)`` if it did not come)."""
        end = None if within is None else time.monotonic() + within

        def decided():
            return rnd in self._verdicts or (end is not None and time.monotonic() > end)
        signum = self._wait(decided, f"waiting for round {rnd}'s verdict", interrupted, LOST_AFTER_S)
        if signum:
            return None, signum
        return self._verdicts.get(rnd, (None, None))

