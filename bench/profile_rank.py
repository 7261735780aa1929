"""Run a module under ringcomm.launch with one rank under cProfile.

    python -m ringcomm.launch --nproc 4 bench/profile_rank.py OUT.prof [--rank R] -- MODULE [ARGS...]

Rank ``R`` (default 0) runs ``python -m MODULE ARGS`` under :mod:`cProfile` and writes its
statistics to ``OUT.prof`` (read them with :mod:`pstats`); the other ranks run it plainly,
so only one rank pays the profiler's overhead.

>>> python -m ringcomm.launch --nproc 4 bench/profile_rank.py z3.prof -- ringcomm.train --strategy zero3
"""
import argparse
import cProfile
import os
import runpy
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="where the profiled rank writes its statistics")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("module")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args()
    sys.argv = [ns.module, *ns.args]
    if int(os.environ.get("RANK", "0")) == ns.rank:
        profile = cProfile.Profile()
        try:
            profile.runcall(runpy.run_module, ns.module, run_name="__main__")
        finally:
            profile.dump_stats(ns.out)
    else:
        runpy.run_module(ns.module, run_name="__main__")


if __name__ == "__main__":
    main()
