"""Rendezvous: every rank learns every other rank's address through rank 0.

Rank 0 binds a ROUTER socket at ``MASTER_ADDR:MASTER_PORT``. Every other rank binds its own
inbound socket first, then joins through a challenge and response, so the job secret never
crosses the wire and nothing recorded from one rendezvous works in another:

1. the rank sends ``HELLO`` with a fresh random nonce;
2. rank 0 answers ``CHALLENGE`` with a fresh nonce of its own and the job's name (see
   :func:`ringcomm.env.job_id`), signed (HMAC-SHA256 under the secret) over both nonces: the
   rank learns that rank 0 knows the secret and that this is its own job;
3. the rank sends ``JOIN``: its rank, the world size it expects, its addresses, its process
   (pid, start time and pid namespace: what its same-host peers watch, see :mod:`.liveness`),
   its settings and job, signed over both nonces; rank 0 accepts each challenge's answer once;
4. when all ranks have joined, rank 0 sends each the address table, signed over its nonces.

Messages that fail a check are ignored with a log line (a stranger, a replayed message). A
rank of another job, or a second rank claiming a rank already taken, is refused alone; a
rank of this job whose world size or settings differ fails the whole rendezvous, on every
rank, naming the difference. Messages are JSON, never pickle, and capped in size.

Rank r then reaches rank p over ``ipc://`` when both run on the same host and over
``tcp://`` otherwise (``RINGCOMM_TRANSPORT=tcp`` forces TCP everywhere).
"""
import collections
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time

import zmq

from .. import rundir
from ..errors import CommError, CommTimeout
from . import liveness

log = logging.getLogger(__name__)
MAX_HELLO_BYTES = 64 * 1024
NONCE_BYTES = 16
MAX_CHALLENGES = 4096    # outstanding challenges rank 0 remembers (oldest forgotten first)
RESEND_S = 2.0           # a rank without a challenge says HELLO again after this
HANDSHAKE_MS = 10_000    # a peer connection must prove the secret within this
MAX_IPC_PATH = 107       # sun_path of a Unix socket address, less its terminating NUL


def host_id():
    """Identifies this host: its name, kernel boot id, network and mount namespaces (ranks
    with equal ids reach each other's ``ipc://`` sockets)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    namespaces = []
    for kind in ("net", "mnt"):  # ipc sockets are files: the same files and network
        try:
            namespaces.append(os.readlink(f"/proc/self/ns/{kind}"))
        except OSError:
            namespaces.append("")
    return "/".join([socket.gethostname(), boot, *namespaces])


def _given_ips():
    return [a.strip() for a in os.environ.get("RINGCOMM_IFADDR", "").split(",") if a.strip()]


def chosen_ip(local_rank=0):
    """The address ``RINGCOMM_IFADDR`` gives this rank, or ``None``: one address for every
    rank of the host, or a comma-separated list of one per local rank (a host with a
    network interface per rank)."""
    given = _given_ips()
    if not given:
        return None
    if len(given) == 1:
        return given[0]
    if not 0 <= local_rank < len(given):
        raise CommError(f"RINGCOMM_IFADDR lists {len(given)} addresses, one per local rank, "
                        f"but this rank's local rank is {local_rank}")
    return given[local_rank]


def source_ip(local_rank=0):
    """Where this rank's TCP connections leave from: its own address when ``RINGCOMM_IFADDR``
    lists one per local rank (so each rank's traffic takes its own interface), else
    ``None`` (the routing table chooses)."""
    return chosen_ip(local_rank) if len(_given_ips()) > 1 else None


def local_ip(master_addr, local_rank=0):
    """The address of this host's interface towards ``master_addr`` (loopback stays
    loopback), unless ``RINGCOMM_IFADDR`` names one (see :func:`chosen_ip`)."""
    chosen = chosen_ip(local_rank)
    if chosen:
        return chosen
    ip = socket.gethostbyname(master_addr)
    if ip.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, 9))  # a UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


def bind_pull(context, master_addr, max_message_bytes, guard, need_tcp, local_rank=0):
    """This rank's inbound socket, bound to an ipc path in this user's private run directory
    (:mod:`ringcomm.rundir`) and, when ``need_tcp`` (peers on other hosts, or
    ``RINGCOMM_TRANSPORT=tcp``), to a TCP port on :func:`local_ip`; and its table entry.
    ``guard`` (a :class:`~.security.Guard`) makes it refuse peers that do not prove the job
    secret."""
    pull = context.socket(zmq.PULL)
    guard.server(pull)
    pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    pull.setsockopt(zmq.LINGER, 0)
    # a connection that has not proven the secret by then is dropped, so half-open
    # connections from a stranger cannot pile up
    pull.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    tcp = None
    if need_tcp:
        ip = local_ip(master_addr, local_rank)
        tcp = f"tcp://{ip}:{pull.bind_to_random_port(f'tcp://{ip}')}"
    directory = rundir.path()
    rundir.remove_stale(directory)
    path = os.path.join(directory, f"{rundir.owner()}-{secrets.token_hex(4)}.sock")
    if len(path.encode()) > MAX_IPC_PATH:
        pull.close(0)
        raise CommError(f"the ipc socket path {path} is longer than {MAX_IPC_PATH} bytes; set "
                        f"XDG_RUNTIME_DIR or TMPDIR to a shorter private directory")
    pull.bind(f"ipc://{path}")
    # the process (pid, start time, pid namespace): what same-host peers watch (see .liveness)
    entry = {"host": host_id(), **liveness.identity(), "ipc": f"ipc://{path}", "tcp": tcp,
             "id": guard.socket_id}
    return pull, entry


def endpoints_for(me, table, force_tcp=False, source=None):
    """The address this rank uses to reach each rank of ``table``; TCP connections leave
    from address ``source`` when given (a rank with a network interface of its own)."""
    endpoints = []
    for r, e in enumerate(table):
        if e["host"] == me["host"] and not force_tcp:
            endpoints.append(e["ipc"])
        elif e.get("tcp"):
            # ZeroMQ's "source;destination" form: port 0, any free port on that address
            src = f"[{source}]" if source and ":" in source else source
            endpoints.append(e["tcp"] if source is None else f"tcp://{src}:0;{e['tcp'][len('tcp://'):]}")
        else:
            raise CommError(f"rank {r} runs on another host but offers no TCP address: "
                            f"LOCAL_WORLD_SIZE said every rank shares one host")
    return endpoints


def socket_files(entry):
    """The files this rank's ``entry`` created (its ipc socket)."""
    return [entry["ipc"][len("ipc://"):]]


def sign(secret, *parts):
    """HMAC-SHA256 under the job secret of ``parts`` joined by ``|`` (the launchers' round
    messages are signed this way too)."""
    return hmac.new(secret.encode(), b"|".join(parts), hashlib.sha256).digest()


def verified(secret, mac, *parts):
    return hmac.compare_digest(sign(secret, *parts), mac)


def exchange(context, rank, world_size, master_addr, master_port, entry, settings, secret, job,
             timeout):
    """Return the address table (one entry per rank) once every rank has joined.

    ``job`` names this launch (see :func:`ringcomm.env.job_id`): a rank of another job that
    shares the port and the secret is refused without disturbing this one."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        return _Server(context, world_size, master_addr, master_port, entry, settings, secret,
                       job).serve(deadline)
    return _join(context, rank, world_size, master_addr, master_port, entry, settings, secret,
                 job, deadline)


class _Server:
    """Rank 0's side: challenges every newcomer, admits ranks that answer it correctly."""

    def __init__(self, context, world_size, master_addr, master_port, entry, settings, secret, job):
        self.world_size, self.settings, self.secret, self.job = world_size, settings, secret, job
        self.table, self.joined = {0: entry}, {}  # rank -> entry, rank -> (identity, nonces)
        self.challenges = collections.OrderedDict()  # identity -> (client nonce, server nonce)
        self.address = f"tcp://{socket.gethostbyname(master_addr)}:{master_port}"
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_HELLO_BYTES)
        self.router.setsockopt(zmq.LINGER, 2000)
        try:
            self.router.bind(self.address)
        except zmq.ZMQError as exc:
            self.router.close(0)
            raise CommError(f"rank 0 cannot bind the rendezvous at {self.address}: {exc}") from None

    def serve(self, deadline):
        try:
            while len(self.table) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.router.poll(int(remaining * 1000)):
                    missing = sorted(set(range(self.world_size)) - set(self.table))
                    raise CommTimeout(f"rendezvous at {self.address}: ranks {missing} did not "
                                      f"join within the timeout")
                parts = self.router.recv_multipart()
                if len(parts) == 3 and parts[1] == b"HELLO" and len(parts[2]) == NONCE_BYTES:
                    self._challenge(parts[0], parts[2])
                elif len(parts) == 4 and parts[1] == b"JOIN":
                    self._admit(parts[0], parts[2], parts[3])
                else:
                    log.warning("rendezvous: ignored a malformed message")
            ordered = [self.table[r] for r in range(self.world_size)]
            for ident, nonces in self.joined.values():
                self._reply(ident, nonces, {"table": ordered})
            return ordered
        finally:
            self.router.close()

    def _challenge(self, ident, client_nonce):
        known = self.challenges.get(ident)
        # a repeated HELLO gets the same challenge: the rank answers whichever reaches it first
        server_nonce = known[1] if known and known[0] == client_nonce else secrets.token_bytes(NONCE_BYTES)
        self.challenges[ident] = (client_nonce, server_nonce)
        while len(self.challenges) > MAX_CHALLENGES:  # a flood of HELLOs cannot grow memory
            self.challenges.popitem(last=False)
        job = self.job.encode()
        self.router.send_multipart([ident, b"CHALLENGE", server_nonce, job,
                                    sign(self.secret, b"challenge", client_nonce, server_nonce, job)])

    def _admit(self, ident, body, mac):
        nonces = self.challenges.pop(ident, None)
        if nonces is None or not verified(self.secret, mac, b"join", *nonces, body):
            log.warning("rendezvous: ignored a join that does not answer its challenge "
                        "(a stranger, or a replayed message)")
            return
        try:
            hello = json.loads(body)
            r, job = hello["rank"], hello["job"]
            valid = isinstance(r, int) and isinstance(hello["entry"], dict) and isinstance(job, str)
        except (ValueError, KeyError, TypeError):
            valid = False
        if not valid:
            log.warning("rendezvous: ignored a malformed join")
            return
        if job != self.job:
            problem = f"rank {r} of job {job!r} reached the rendezvous of job {self.job!r}"
        elif not 0 < r < self.world_size or r in self.table:
            problem = f"rank {r} joined twice or is out of range (world size {self.world_size})"
        else:
            problem = None
        if problem:  # refuse the newcomer alone: the ranks already here stay
            log.warning("rendezvous: refused: %s", problem)
            self._reply(ident, nonces, {"error": problem})
            return
        mismatch = None
        if hello.get("world_size") != self.world_size:
            mismatch = f"rank {r} expects world size {hello.get('world_size')}, rank 0 has {self.world_size}"
        elif hello.get("settings") != self.settings:
            mismatch = (f"rank {r} has settings {hello.get('settings')}, rank 0 has {self.settings} "
                        f"(every rank needs the same RINGCOMM_SEGMENT_BYTES, RINGCOMM_SHM, "
                        f"RINGCOMM_SHM_SLOTS, RINGCOMM_TRANSPORT, RINGCOMM_P2P_WINDOW_BYTES and "
                        f"RINGCOMM_COLLECTIVE_WINDOW: the "
                        f"segment size default "
                        f"follows the last ones)")
        if mismatch:  # a rank of this job, configured differently: the job cannot run
            for other, other_nonces in [*self.joined.values(), (ident, nonces)]:
                self._reply(other, other_nonces, {"error": mismatch})
            raise CommError(f"rendezvous failed: {mismatch}")
        self.table[r], self.joined[r] = hello["entry"], (ident, nonces)

    def _reply(self, ident, nonces, message):
        body = json.dumps(message).encode()
        self.router.send_multipart([ident, b"REPLY", body, sign(self.secret, b"reply", *nonces, body)])


def _join(context, rank, world_size, master_addr, master_port, entry, settings, secret, job, deadline):
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
    address = f"tcp://{master_addr}:{master_port}"
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    server_nonce = None

    def receive(again=None):
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommTimeout(f"rank {rank}: no answer from the rendezvous at {address} "
                                  f"(rank 0) within the timeout")
            if dealer.poll(int(min(remaining, RESEND_S if again else remaining) * 1000)):
                yield dealer.recv_multipart()
            elif again:  # a flood of strangers' HELLOs may have pushed ours out
                again()
    try:
        dealer.connect(address)
        hello = lambda: dealer.send_multipart([b"HELLO", client_nonce])  # noqa: E731
        hello()
        for parts in receive(again=hello):
            if len(parts) == 4 and parts[0] == b"CHALLENGE" and \
                    verified(secret, parts[3], b"challenge", client_nonce, parts[1], parts[2]):
                server_nonce = parts[1]
                if parts[2] != job.encode():
                    raise CommError(f"rank {rank}: the rendezvous at {address} belongs to job "
                                    f"{parts[2].decode(errors='replace')!r}, this rank to job {job!r}")
                break
        body = json.dumps({"rank": rank, "world_size": world_size, "entry": entry,
                           "settings": settings, "job": job}).encode()
        dealer.send_multipart([b"JOIN", body, sign(secret, b"join", client_nonce, server_nonce, body)])
        for parts in receive():
            if len(parts) == 3 and parts[0] == b"REPLY" and \
                    verified(secret, parts[2], b"reply", client_nonce, server_nonce, parts[1]):
                break
        reply = json.loads(parts[1])
        if "error" in reply:
            raise CommError(f"rendezvous failed: {reply['error']}")
        return reply["table"]
    finally:
        dealer.close()
