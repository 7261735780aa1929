"""``python -m ringcomm.checkpoint list|consolidate``: the checkpoint tool. The format and
the code are in :mod:`ringcomm.train.checkpoint`."""
import sys

from .train.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
