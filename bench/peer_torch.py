"""torch.distributed (Gloo backend) all-reduce worker of bench/peers.py, one process per rank.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p GLOO_SOCKET_IFNAME=lo \\
        python bench/peer_torch.py --control 127.0.0.1:PORT

Joins the process group with ``init_method=tcp://MASTER_ADDR:MASTER_PORT`` (the driver
starts the n processes with torchrun's environment variables) and answers the driver's "run"
commands (see bench/control.py) with ``dist.all_reduce(torch.from_numpy(x))``, in place on
the same memory, and ``dist.barrier()`` between calls. One intra-op thread per rank, as
torchrun sets OMP_NUM_THREADS=1 when several workers share a host.
"""
import argparse
import os
from datetime import timedelta

import control


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", required=True, help="the driver's HOST:PORT")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:"
                            f"{os.environ['MASTER_PORT']}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=300))
    tensors = {}  # id of the numpy buffer -> the tensor sharing its memory

    def all_reduce(x, _algorithm):
        t = tensors.get(id(x))
        if t is None:
            t = tensors[id(x)] = torch.from_numpy(x)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)

    control.serve(args.control, "gloo", rank, n, dist.barrier, all_reduce,
                  version=f"torch {torch.__version__}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
