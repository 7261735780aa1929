"""Rendezvous: every rank learns every other rank's address through rank 0.

Rank 0 binds a ROUTER socket at ``MASTER_ADDR:MASTER_PORT``. Every other rank binds its own
PULL socket first, then sends rank 0 a HELLO: its rank, the world size it expects, its
addresses and its settings, with an HMAC-SHA256 of the message under the job secret. Rank 0
checks each HELLO (secret, rank in range and not taken, same world size and settings),
ignores strangers, and when all ranks have joined sends each of them the address table, also
signed. Messages are JSON, never pickle, and capped in size.

Rank r then reaches rank p over ``ipc://`` when both run on the same host and over
``tcp://`` otherwise (``RINGCOMM_TRANSPORT=tcp`` forces TCP everywhere).
"""
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import sys
import tempfile
import time

import zmq

from ..errors import CommError, CommTimeout

log = logging.getLogger(__name__)
MAX_HELLO_BYTES = 64 * 1024


def host_id():
    """Identifies this host: its name, kernel boot id and network namespace (ranks with equal
    ids reach each other's ``ipc://`` sockets)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{socket.gethostname()}/{boot}/{netns}"


def local_ip(master_addr):
    """The address of this host's interface towards ``master_addr`` (loopback stays loopback)."""
    if os.environ.get("RINGCOMM_IFADDR"):
        return os.environ["RINGCOMM_IFADDR"]
    ip = socket.gethostbyname(master_addr)
    if ip.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, 9))  # a UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


def bind_pull(context, master_addr, max_message_bytes, guard=None):
    """This rank's inbound socket, bound to an ipc path and a TCP port; and its table entry.
    ``guard`` (a :class:`~.security.Guard`) makes it refuse peers without the job secret."""
    pull = context.socket(zmq.PULL)
    if guard is not None:
        guard.server(pull)
    pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    pull.setsockopt(zmq.LINGER, 0)
    ip = local_ip(master_addr)
    port = pull.bind_to_random_port(f"tcp://{ip}")
    name = f"ringcomm-{os.getpid()}-{secrets.token_hex(4)}.sock"
    # Linux's abstract socket namespace ("@name") leaves no file behind when a rank is
    # killed; it has no file permissions either, which the job secret's handshake replaces
    path = f"@{name}" if sys.platform.startswith("linux") else os.path.join(tempfile.gettempdir(), name)
    pull.bind(f"ipc://{path}")
    entry = {"host": host_id(), "pid": os.getpid(), "ipc": f"ipc://{path}", "tcp": f"tcp://{ip}:{port}"}
    return pull, entry


def endpoints_for(me, table, force_tcp=False):
    """The address this rank uses to reach each rank of ``table``."""
    return [e["ipc"] if e["host"] == me["host"] and not force_tcp else e["tcp"] for e in table]


def socket_files(entry):
    """The files this rank's ``entry`` created (none for an abstract-namespace socket)."""
    path = entry["ipc"][len("ipc://"):]
    return [] if path.startswith("@") else [path]


def _sign(secret, body):
    return hmac.new(secret.encode(), body, hashlib.sha256).digest()


def _verified(secret, body, mac):
    return hmac.compare_digest(_sign(secret, body), mac)


def exchange(context, rank, world_size, master_addr, master_port, entry, settings, secret, timeout):
    """Return the address table (one entry per rank) once every rank has joined."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        return _serve(context, world_size, master_addr, master_port, entry, settings, secret, deadline)
    return _join(context, rank, world_size, master_addr, master_port, entry, settings, secret, deadline)


def _serve(context, world_size, master_addr, master_port, entry, settings, secret, deadline):
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.MAXMSGSIZE, MAX_HELLO_BYTES)
    router.setsockopt(zmq.LINGER, 2000)
    address = f"tcp://{socket.gethostbyname(master_addr)}:{master_port}"
    try:
        router.bind(address)
    except zmq.ZMQError as exc:
        router.close(0)
        raise CommError(f"rank 0 cannot bind the rendezvous at {address}: {exc}") from None
    try:
        table, identities = {0: entry}, {}
        while len(table) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not router.poll(int(remaining * 1000)):
                missing = sorted(set(range(world_size)) - set(table))
                raise CommTimeout(f"rendezvous at {address}: ranks {missing} did not join "
                                  f"within the timeout")
            parts = router.recv_multipart()
            hello = _parse_hello(parts, secret)
            if hello is None:
                log.warning("rendezvous: ignored a message without a valid job secret")
                continue
            r = hello["rank"]
            problem = None
            if hello["world_size"] != world_size:
                problem = f"rank {r} expects world size {hello['world_size']}, rank 0 has {world_size}"
            elif hello["settings"] != settings:
                problem = (f"rank {r} has settings {hello['settings']}, rank 0 has {settings} (every rank "
                           f"needs the same RINGCOMM_SEGMENT_BYTES, RINGCOMM_SHM, RINGCOMM_SHM_SLOTS and "
                           f"RINGCOMM_TRANSPORT: the segment size default follows the last ones)")
            elif not 0 < r < world_size or r in table:
                problem = f"rank {r} joined twice or is out of range (world size {world_size})"
            if problem:
                for ident in [*identities.values(), parts[0]]:
                    _reply(router, ident, {"error": problem}, secret)
                raise CommError(f"rendezvous failed: {problem}")
            table[r], identities[r] = hello["entry"], parts[0]
        ordered = [table[r] for r in range(world_size)]
        for ident in identities.values():
            _reply(router, ident, {"table": ordered}, secret)
        return ordered
    finally:
        router.close()


def _parse_hello(parts, secret):
    if len(parts) != 3 or not _verified(secret, parts[1], parts[2]):
        return None
    try:
        hello = json.loads(parts[1])
        if not isinstance(hello["rank"], int) or not isinstance(hello["entry"], dict):
            return None
        return hello
    except (ValueError, KeyError, TypeError):
        return None


def _reply(router, ident, message, secret):
    body = json.dumps(message).encode()
    router.send_multipart([ident, body, _sign(secret, body)])


def _join(context, rank, world_size, master_addr, master_port, entry, settings, secret, deadline):
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
    address = f"tcp://{master_addr}:{master_port}"
    try:
        dealer.connect(address)
        body = json.dumps({"rank": rank, "world_size": world_size, "entry": entry,
                           "settings": settings}).encode()
        dealer.send_multipart([body, _sign(secret, body)])
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not dealer.poll(int(remaining * 1000)):
                raise CommTimeout(f"rank {rank}: no answer from the rendezvous at {address} "
                                  f"(rank 0) within the timeout")
            parts = dealer.recv_multipart()
            if len(parts) == 2 and _verified(secret, parts[0], parts[1]):
                break
        reply = json.loads(parts[0])
        if "error" in reply:
            raise CommError(f"rendezvous failed: {reply['error']}")
        return reply["table"]
    finally:
        dealer.close()
