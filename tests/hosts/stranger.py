"""A stranger on another host who knows a rank's TCP address and port but not the job
secret (tests/hosts/test_encryption_across_hosts.py). It tries, in turn: a ZeroMQ
connection without credentials, one with a CURVE key pair of its own, one with a made-up
PLAIN proof, each sending frames with well-formed ringcomm headers; and a raw TCP connection
writing a header and garbage. Exits 0 once it has tried all; whether anything got through is
for the rank to say."""
import contextlib
import socket
import sys
import time

import zmq

from ringcomm.transport import frame


def forged():
    header = frame.pack(frame.Kind.DATA, 1, frame.Key(0, 0, 10 ** 6, 0, 0), 4, bytes(16))
    return [[header, b"\0" * 4], [header + b"\0" * 4], [b"junk"]]


def try_zmq(endpoint, setup):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    setup(sock)
    sock.connect(endpoint)
    for parts in forged():
        with contextlib.suppress(zmq.Again):  # no pipe: the handshake never completed
            sock.send_multipart(parts, zmq.NOBLOCK)
    time.sleep(1.0)
    ctx.destroy(0)


def curve(sock):
    public, secret = zmq.curve_keypair()
    server_public, _ = zmq.curve_keypair()
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public


def plain(sock):
    sock.plain_username, sock.plain_password = b"1", b"ab" * 16 + b":" + b"0" * 64


def main(endpoint):
    try_zmq(endpoint, lambda sock: None)
    try_zmq(endpoint, curve)
    try_zmq(endpoint, plain)
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + forged()[1][0] + b"garbage" * 100)
        time.sleep(0.5)


if __name__ == "__main__":
    main(sys.argv[1])
