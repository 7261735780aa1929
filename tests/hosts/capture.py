"""Record every frame through one network interface to a file, raw, until SIGTERM.

    ip netns exec NS python capture.py IFACE OUT

A packet socket (AF_PACKET, every protocol) bound to IFACE sees both directions; frames are
appended as they come, so what the file holds is what crossed the wire (enough to search it
for bytes that must not appear in clear). Prints ``listening`` once it is bound."""
import signal
import socket
import sys

ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33  # Linux; not exported by the socket module


def main(iface, out):
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)  # root: past rmem_max
    sock.bind((iface, 0))
    sock.settimeout(0.2)
    print("listening", flush=True)
    with open(out, "wb") as f:
        while not stop:
            try:
                f.write(sock.recv(1 << 18))
            except socket.timeout:
                continue
            except InterruptedError:
                continue


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
