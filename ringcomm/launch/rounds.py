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
   k, one that was interrupted (SIGINT, SIGTERM) says QUIT k;
3. the first FAILED or QUIT decides the round: every agent gets STOP k with the verdict
   RESTART (while k < K, and not after a QUIT) or GIVE_UP, and its launcher stops its
   workers; DONE from every node gets FINISHED;
4. after RESTART every launcher joins round k+1 once its workers are stopped.

The coordinator sends a heartbeat every second; an agent that hears nothing for
``LOST_AFTER_S`` while it waits gives up, saying the coordinator is lost. Nodes that do not
join a round within ``join_timeout`` seconds end the job (GIVE_UP). Every message is
``MAGIC``, an HMAC-SHA256 of the JSON that follows under the job secret, and the JSON: a
message without the right HMAC is dropped, so a stranger can neither stop nor restart the
job. No pickle.

>>> agent = Agent(cfg); go = agent.join(0)         # blocks until every node joined round 0
>>> agent.failed(0); agent.verdict(0)              # 'restart' or 'give_up'
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time

import zmq

MAGIC = b"RCL1"
HEARTBEAT_S = 1.0
LOST_AFTER_S = 15.0
RESTART, GIVE_UP, FINISHED = "restart", "give_up", "finished"


class RoundsError(RuntimeError):
    """The launchers could not agree: a node did not come, or the coordinator was lost."""


def _seal(secret: str, doc: dict) -> bytes:
    body = json.dumps(doc, sort_keys=True).encode()
    return MAGIC + hmac.new(secret.encode(), body, hashlib.sha256).digest() + body


def _open(secret: str, frame: bytes):
    """The message in ``frame``, or None if it is not one sealed under ``secret``."""
    if len(frame) < 36 or frame[:4] != MAGIC:
        return None
    mac, body = frame[4:36], frame[36:]
    if not hmac.compare_digest(mac, hmac.new(secret.encode(), body, hashlib.sha256).digest()):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("round"), int) else None


class Coordinator:
    """Node 0's side, in a thread of its own: counts joins, decides each round."""

    def __init__(self, *, nnodes, max_restarts, addr, port, secret, job, worker_port, join_timeout, log):
        self.nnodes, self.max_restarts, self.secret = nnodes, max_restarts, secret
        self.job, self.worker_port, self.join_timeout, self.log = job, worker_port, join_timeout, log
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 2000)  # the last verdicts still leave after close
        self._sock.bind(f"tcp://{addr}:{port}")
        self._round, self._joined, self._done, self._verdicts = 0, {}, set(), {}
        self._round_opened = time.monotonic()
        self._peers = {}  # node -> the agent's ZeroMQ identity
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ringcomm-launch-rounds", daemon=True)
        self._thread.start()

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()

    def _send(self, node, doc):
        ident = self._peers.get(node)
        if ident is not None:
            self._sock.send_multipart([ident, _seal(self.secret, doc)])

    def _broadcast(self, doc):
        for node in list(self._peers):
            self._send(node, doc)

    def _serve(self):
        beat = time.monotonic()
        while not self._stop.is_set():
            if self._sock.poll(100):
                ident, frame = (self._sock.recv_multipart() + [b""])[:2]
                doc = _open(self.secret, frame)
                node = doc.get("node") if doc else None
                if doc is None or not isinstance(node, int) or not 0 <= node < self.nnodes:
                    self.log("rounds: dropped a message that is not signed with the job secret")
                    continue
                self._peers[node] = ident
                self._handle(node, doc)
            now = time.monotonic()
            if now - beat >= HEARTBEAT_S:
                beat = now
                self._broadcast({"kind": "beat", "round": self._round})
            if (self._round not in self._verdicts and len(self._joined) < self.nnodes
                    and now - self._round_opened > self.join_timeout):
                missing = sorted(set(range(self.nnodes)) - set(self._joined))
                self._decide(GIVE_UP, f"node(s) {missing} did not join round {self._round} "
                                      f"within {self.join_timeout:g} s")

    def _handle(self, node, doc):
        kind, rnd = doc.get("kind"), doc["round"]
        if kind == "join" and rnd == self._round + 1 and self._verdicts.get(self._round, (None,))[0] == RESTART:
            self._round, self._joined, self._done = rnd, {}, set()
            self._round_opened = time.monotonic()
        if rnd != self._round:
            return  # a message of an earlier round: that round is decided
        if kind == "join":
            self._joined[node] = True
            if len(self._joined) == self.nnodes:
                self._broadcast({"kind": "go", "round": rnd, "job": self.job, "port": self.worker_port})
        elif rnd in self._verdicts:  # a report after the verdict: say the verdict again
            self._send(node, self._verdict_doc(rnd))
        elif kind == "done":
            self._done.add(node)
            if len(self._done) == self.nnodes:
                self._decide(FINISHED, "every node's workers succeeded")
        elif kind in ("failed", "quit"):
            restart = kind == "failed" and rnd < self.max_restarts
            why = f"node {node}'s workers {'failed' if kind == 'failed' else 'were interrupted'}"
            self._decide(RESTART if restart else GIVE_UP, why)

    def _decide(self, verdict, why):
        self._verdicts[self._round] = (verdict, why)
        self._broadcast(self._verdict_doc(self._round))

    def _verdict_doc(self, rnd):
        verdict, why = self._verdicts[rnd]
        return {"kind": "verdict", "round": rnd, "verdict": verdict, "why": why}


class Agent:
    """One launcher's side: join a round, report how it went, hear the verdict."""

    def __init__(self, *, node, addr, port, secret, join_timeout, lost_after=LOST_AFTER_S):
        self.node, self.secret, self.join_timeout = node, secret, join_timeout
        self.lost_after = lost_after
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._where = f"{addr}:{port}"
        self._sock.connect(f"tcp://{self._where}")
        self._heard = time.monotonic()
        self._verdicts = {}  # round -> (verdict, why)
        self._go = {}        # round -> GO message

    def close(self):
        self._sock.close()
        self._ctx.term()

    def _say(self, kind, rnd):
        self._sock.send(_seal(self.secret, {"kind": kind, "round": rnd, "node": self.node}))

    def _take(self, timeout_ms):
        """File whatever the coordinator said within ``timeout_ms``."""
        if not self._sock.poll(timeout_ms):
            return
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            doc = _open(self.secret, frame)
            if doc is None:
                continue
            self._heard = time.monotonic()
            if doc.get("kind") == "go":
                self._go[doc["round"]] = doc
            elif doc.get("kind") == "verdict":
                self._verdicts[doc["round"]] = (doc.get("verdict"), doc.get("why", ""))

    def join(self, rnd):
        """Wait until every node joined round ``rnd``: its GO (``job``, ``port``), or the
        verdict that ended the job instead (a dict with ``verdict``)."""
        self._say("join", rnd)
        deadline = time.monotonic() + self.join_timeout + self.lost_after
        self._heard = None  # the coordinator may not be up yet: only the deadline counts
        while rnd not in self._go:
            if rnd in self._verdicts:
                verdict, why = self._verdicts[rnd]
                return {"verdict": verdict, "why": why}
            now = time.monotonic()
            if now > deadline or (self._heard is not None and now - self._heard > self.lost_after):
                raise RoundsError(f"no word from the coordinating launcher (node 0, "
                                  f"{self._where}) about round {rnd}")
            self._take(100)
        return self._go[rnd]

    def stop_requested(self, rnd):
        """Whether round ``rnd`` was decided elsewhere (non-blocking)."""
        self._take(0)
        return rnd in self._verdicts

    def report(self, kind, rnd):
        """Say how round ``rnd`` went here: ``done``, ``failed`` or ``quit``."""
        self._say(kind, rnd)

    def verdict(self, rnd):
        """Wait for round ``rnd``'s verdict: (verdict, why)."""
        self._heard = time.monotonic()
        while rnd not in self._verdicts:
            if time.monotonic() - self._heard > self.lost_after:
                raise RoundsError(f"lost the coordinating launcher (node 0, {self._where}): nothing "
                                  f"heard for {self.lost_after:g} s while waiting for round {rnd}'s verdict")
            self._take(200)
        return self._verdicts[rnd]


def job_name(given):
    """The name every round's workers share (the round is added by ringcomm.env.job_id)."""
    return given or secrets.token_hex(8)
