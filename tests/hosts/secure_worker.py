"""One rank of a two-host job that strangers try to get into (tests/hosts/
test_encryption_across_hosts.py). Rank 0 writes its TCP address and how many frames it
has rejected so far to ``DIR/address``, every rank waits for ``DIR/go`` (the strangers have
had their turn), then rank 0 broadcasts a payload full of a marker the capture looks for,
and an all-reduce checks the job still computes right. Rank 0 writes ``DIR/result``."""
import json
import os
import sys
import time

import numpy as np

import ringcomm

MARKER = b"RINGCOMM-PAYLOAD-IN-CLEAR:"


def main(directory):
    comm = ringcomm.init()
    transport = comm._engine.session.wire
    if comm.rank == 0:
        with open(os.path.join(directory, "address.tmp"), "w") as f:
            json.dump({"tcp": transport.bound["tcp"], "rejected": transport.rejected}, f)
        os.rename(os.path.join(directory, "address.tmp"), os.path.join(directory, "address"))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(directory, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    payload = np.frombuffer(MARKER * (1 << 12), np.uint8).copy()
    mine = payload if comm.rank == 0 else np.zeros_like(payload)
    comm.broadcast(mine, root=0)
    x = np.full(50_000, comm.rank + 1.0)
    comm.all_reduce(x)
    ok = bool(np.array_equal(mine, payload) and np.all(x == 3.0))
    if comm.rank == 0:
        with open(os.path.join(directory, "result"), "w") as f:
            json.dump({"ok": ok, "rejected": transport.rejected, "encrypted": transport._guard.encrypt}, f)
    comm.close()


if __name__ == "__main__":
    main(sys.argv[1])
