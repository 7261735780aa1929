"""Keeping strangers out: every peer connection proves the job secret without sending it.

Each rank runs a ZAP authenticator (ZeroMQ's authentication protocol) for its inbound
socket; a connection that does not prove the secret is refused during the ZeroMQ handshake,
before a single frame of it reaches the rank.

- ranks that all share one host (``RINGCOMM_ENCRYPT`` unset), or ``RINGCOMM_ENCRYPT=0``
  (every rank must say the same, or connections are refused): ZeroMQ's **PLAIN** mechanism
  carrying a **one-time proof** instead of a password. Rank r connecting to the socket
  published as ``id`` sends user ``r`` and
  ``nonce:HMAC-SHA256(secret, "ringcomm-peer|id|r|nonce")`` with a fresh random nonce. The
  receiving rank checks the HMAC against its own ``id`` and refuses a nonce it has already
  accepted, so a sniffed handshake replayed later, or sent to another socket, is refused,
  and the secret itself never crosses the wire. Traffic is not encrypted. For the same
  reason a connection is made once: sockets do not reconnect, and a dropped connection is a
  lost peer (:class:`~ringcomm.errors.PeerLost`), as in NCCL.
- ranks on several hosts (``RINGCOMM_ENCRYPT`` unset), or ``RINGCOMM_ENCRYPT=1``:
  **CURVE**. Every rank derives the same Curve25519 key pair from the secret; a peer must
  complete the CURVE handshake with that key (which proves it knows the secret) and all
  traffic through ZeroMQ is encrypted, so neither the payload nor the secret crosses a
  network in clear. Costs CPU per byte; what ranks of one host move through their
  shared-memory lanes and channels never touches ZeroMQ and pays nothing.

The rendezvous proves the secret separately (a challenge and response, see
:mod:`.rendezvous`).
"""
import hashlib
import hmac
import logging
import secrets
import threading

import zmq
import zmq.auth.thread

log = logging.getLogger(__name__)
DOMAIN = "ringcomm"
MAX_NONCES = 1 << 16  # accepted nonces remembered per rank (a job makes world_size of them)


def job_keypair(secret):
    """The (public, secret) Curve25519 key pair every rank derives from the job secret."""
    raw = hashlib.sha256(b"ringcomm-curve:" + secret.encode()).digest()
    secret_key = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def peer_proof(secret, socket_id, rank, nonce):
    """What rank ``rank`` shows the socket ``socket_id`` to prove the secret, with ``nonce``."""
    body = f"ringcomm-peer|{socket_id}|{rank}|{nonce}".encode()
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class _Authenticator(zmq.auth.thread.ThreadAuthenticator):
    """A ZAP handler that accepts one-time proofs (PLAIN) or the job's CURVE key."""

    def __init__(self, context, secret, socket_id, world_size, public=None):
        super().__init__(context, log=log)
        self._secret, self._socket_id, self._world_size = secret, socket_id, world_size
        self._public = public
        self._seen = set()
        self._lock = threading.Lock()

    def _authenticate_plain(self, domain, username, password):
        try:
            return self._check_proof(username, password)
        except Exception:  # noqa: BLE001 - a stranger's bytes must never end this thread
            log.warning("refused a connection with malformed credentials")
            return False, b"malformed credentials"

    def _check_proof(self, username, password):
        rank = int(username)
        nonce, proof = password.split(":")
        if not 0 <= rank < self._world_size or len(nonce) != 32 or not (nonce + proof).isascii():
            return False, b"malformed credentials"
        expected = peer_proof(self._secret, self._socket_id, rank, nonce)
        if not hmac.compare_digest(proof.encode(), expected.encode()):
            log.warning("refused a connection that does not prove the job secret")
            return False, b"bad proof"
        with self._lock:
            if nonce in self._seen or len(self._seen) >= MAX_NONCES:
                log.warning("refused a replayed connection proof (claiming rank %d)", rank)
                return False, b"replayed proof"
            self._seen.add(nonce)
        return True, b"OK"

    async def _authenticate_curve(self, domain, client_key):
        if client_key == self._public:
            return True, b"OK"
        log.warning("refused a CURVE connection with a foreign key")
        return False, b"foreign key"


class Guard:
    """Applies the job's authentication to sockets; owns the process's ZAP authenticator.

    ``socket_id`` names this rank's inbound socket (published in the rendezvous table, so
    a proof made for it is worthless anywhere else).
    """

    def __init__(self, context, secret, world_size, encrypt=False):
        self.secret, self.encrypt = secret, encrypt
        self.socket_id = secrets.token_hex(16)
        public = None
        if encrypt:
            self.public, self.secret_key = job_keypair(secret)
            public = zmq.utils.z85.decode(self.public)
        self._auth = _Authenticator(context, secret, self.socket_id, world_size, public)
        self._auth.start()

    def server(self, sock):
        """Make ``sock`` (before bind) accept only connections that prove the secret."""
        sock.zap_domain = DOMAIN.encode()
        if self.encrypt:
            sock.curve_server = True
            sock.curve_secretkey = self.secret_key
            sock.curve_publickey = self.public
        else:
            sock.plain_server = True

    def client(self, sock, my_rank, peer_socket_id):
        """Make ``sock`` (before connect) prove the secret to the peer socket it connects to."""
        if self.encrypt:
            sock.curve_serverkey = self.public
            sock.curve_publickey = self.public
            sock.curve_secretkey = self.secret_key
        else:
            nonce = secrets.token_hex(16)
            sock.plain_username = str(my_rank).encode()
            sock.plain_password = f"{nonce}:{peer_proof(self.secret, peer_socket_id, my_rank, nonce)}".encode()

    def stop(self):
        self._auth.stop()
