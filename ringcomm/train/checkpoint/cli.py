"""``python -m ringcomm.checkpoint``: list the checkpoints of a directory, or consolidate one
(sharded or not) into a single file of fp32 parameters by name.

    python -m ringcomm.checkpoint list D                  # every checkpoint in D
    python -m ringcomm.checkpoint consolidate D out.npz   # newest complete one -> fp32 parameters by name
    python -m ringcomm.checkpoint consolidate D/step_000120 out.npz
"""
import argparse
import os
import sys

from .files import MANIFEST, CheckpointError, npz_bytes, resolve, scan, write_durable
from .state import read_full


def consolidate(path, out):
    """Write the fp32 parameters (by name, model order) of the checkpoint at ``path``
    (a checkpoint directory, or the newest complete one under it) to ``out``."""
    entry = resolve(path)
    full = read_full(entry)
    write_durable(out, npz_bytes(dict(zip(full.names(), full.params, strict=True))))
    return entry


def list_checkpoints(root, out=print):
    entries = scan(root)
    if not entries:
        out(f"{root}: no checkpoints")
        return entries
    out(f"{'step':>8}  {'status':<34} {'strategy':<14} {'world':>5}  {'precision':<9} files")
    for e in entries:
        m = e.manifest or {}
        strategy = (m.get("strategy", "-") + (" +offload" if m.get("offload") else "")) if m else "-"
        files = sorted(f for f in os.listdir(e.path) if f.endswith(".npz") or f == MANIFEST)
        status = "complete" if e.complete else f"incomplete ({e.reason})"
        out(f"{e.step:>8}  {status:<34} {strategy:<14} {m.get('world_size', '-'):>5}  "
            f"{m.get('precision', '-'):<9} {' '.join(files)}")
    return entries


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ringcomm.checkpoint", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="the checkpoints in D: step, complete or not, strategy, world size")
    ls.add_argument("dir", metavar="D")
    co = sub.add_parser("consolidate", help="one fp32 parameter file from a (sharded) checkpoint")
    co.add_argument("dir", metavar="D", help="a checkpoint directory, or the newest complete one in D")
    co.add_argument("out", metavar="OUT.npz")
    args = p.parse_args(argv)
    try:
        if args.command == "list":
            list_checkpoints(args.dir)
        else:
            entry = consolidate(args.dir, args.out)
            m = entry.manifest
            model = f"layers {m['layers']}" if "layers" in m else f"the {m.get('model', 'gpt')} {m.get('gpt')}"
            print(f"{args.out}: {m['num_params']} fp32 parameters of {model} from {entry.path} "
                  f"(step {m['step']}, {m['strategy']} on {m['world_size']} rank(s))")
    except (CheckpointError, OSError) as e:
        print(f"ringcomm.checkpoint: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
