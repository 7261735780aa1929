"""Keeping strangers out: every peer connection proves the job secret.

Each rank runs a ZAP authenticator (ZeroMQ's authentication protocol) for its inbound
socket; a connection that does not prove the secret is refused during the ZeroMQ handshake,
before a single frame of it reaches the rank.

- default: the **PLAIN** mechanism, user ``ringcomm``, password = the job secret. Cheap, and
  the right choice on loopback or a trusted network (the secret travels in clear).
- ``encrypt=True`` (``RINGCOMM_ENCRYPT=1``): **CURVE**. Every rank derives the same
  Curve25519 key pair from the secret; a peer must complete the CURVE handshake with that
  key (which proves it knows the secret) and all traffic is encrypted. Costs CPU per byte:
  meant for multi-host jobs over untrusted networks.

The rendezvous proves the secret separately (HMAC on every message, see :mod:`.rendezvous`).
"""
import hashlib
import logging

import zmq
import zmq.auth.thread

log = logging.getLogger(__name__)
USER = b"ringcomm"
DOMAIN = "ringcomm"


def job_keypair(secret):
    """The (public, secret) Curve25519 key pair every rank derives from the job secret."""
    raw = hashlib.sha256(b"ringcomm-curve:" + secret.encode()).digest()
    secret_key = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


class _JobKeyOnly:
    """ZAP credentials provider for CURVE: only the job's own public key may connect."""

    def __init__(self, public):
        self.public = public

    def callback(self, domain, z85_key):
        allowed = z85_key == self.public
        if not allowed:
            log.warning("refused a CURVE connection with a foreign key")
        return allowed


class Guard:
    """Applies the job's authentication to sockets; owns the process's ZAP authenticator."""

    def __init__(self, context, secret, encrypt=False):
        self.secret, self.encrypt = secret, encrypt
        self._auth = zmq.auth.thread.ThreadAuthenticator(context, log=log)
        self._auth.start()
        if encrypt:
            self.public, self.secret_key = job_keypair(secret)
            self._auth.configure_curve_callback(DOMAIN, credentials_provider=_JobKeyOnly(self.public))
        else:
            self._auth.configure_plain(DOMAIN, {USER.decode(): secret})

    def server(self, sock):
        """Make ``sock`` (before bind) accept only connections that prove the secret."""
        sock.zap_domain = DOMAIN.encode()
        if self.encrypt:
            sock.curve_server = True
            sock.curve_secretkey = self.secret_key
            sock.curve_publickey = self.public
        else:
            sock.plain_server = True

    def client(self, sock):
        """Make ``sock`` (before connect) prove the secret to the peer it connects to."""
        if self.encrypt:
            sock.curve_serverkey = self.public
            sock.curve_publickey = self.public
            sock.curve_secretkey = self.secret_key
        else:
            sock.plain_username = USER
            sock.plain_password = self.secret.encode()

    def stop(self):
        self._auth.stop()
