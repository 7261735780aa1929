"""ringcomm all-reduce worker of bench/peers.py (one per rank, under the ringcomm launcher).

    python -m ringcomm.launch --nproc N bench/peer_ringcomm.py --control 127.0.0.1:PORT

Answers the driver's "run" commands (see bench/control.py) with
``comm.all_reduce(x, "sum", algorithm)``, where the algorithm ("ring", "auto", ...) comes
with each command, and ``comm.barrier()`` between calls.
"""
import argparse

import control
import ringcomm


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", required=True, help="the driver's HOST:PORT")
    args = parser.parse_args()
    comm = ringcomm.init()

    def all_reduce(x, algorithm):
        comm.all_reduce(x, "sum", algorithm or "auto")

    control.serve(args.control, "ringcomm", comm.rank, comm.world_size, comm.barrier, all_reduce,
                  version=ringcomm.__version__)
    comm.close()


if __name__ == "__main__":
    main()
