"""The ZeroMQ transport's receive loop against a socket that says "readable" and then has
nothing: libzmq's ZMQ_EVENTS does that for a pipe whose peer connection just ended (seen in
bench/cluster.py at N=4, where it failed a collective with zmq.Again)."""
import pytest
import zmq

from ringcomm.transport.zmq_transport import ZmqTransport

pytestmark = pytest.mark.timeout(30)


class ReadableButEmpty:
    """Stands in for the PULL socket: always POLLIN, never a message."""

    def __init__(self):
        self.attempts = 0

    def get(self, option):
        assert option == zmq.EVENTS
        return zmq.POLLIN

    def recv_multipart(self, flags=0, copy=True):
        self.attempts += 1
        raise zmq.Again()


def test_drain_returns_when_a_readable_socket_has_no_message():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://drain-test")
    transport = ZmqTransport(0, 1, ctx, pull, ["inproc://drain-test"])
    real, transport._pull = transport._pull, ReadableButEmpty()
    try:
        transport._drain()  # must neither raise nor spin
        assert transport._pull.attempts == 1
    finally:
        transport._pull = real
        transport.close()
