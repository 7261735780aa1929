"""Open MPI (mpi4py) all-reduce worker of bench/peers.py, one process per rank.

    mpirun -n N --oversubscribe --allow-run-as-root python bench/peer_mpi.py --control 127.0.0.1:PORT

Answers the driver's "run" commands (see bench/control.py) with
``MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)`` on the numpy buffer (no pickling)
and ``Barrier()`` between calls. Open MPI picks its own algorithm (tuned collectives) and
transport (shared memory between ranks of one host).
"""
import argparse

import control


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", required=True, help="the driver's HOST:PORT")
    args = parser.parse_args()
    from mpi4py import MPI

    world = MPI.COMM_WORLD

    def all_reduce(x, _algorithm):
        world.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

    library = MPI.Get_library_version().splitlines()[0].split(",")[0]
    control.serve(args.control, "openmpi", world.Get_rank(), world.Get_size(), world.Barrier,
                  all_reduce, version=f"{library}, mpi4py {__import__('mpi4py').__version__}")


if __name__ == "__main__":
    main()
