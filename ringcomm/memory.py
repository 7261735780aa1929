"""``python -m ringcomm.memory``: the model-state memory per rank of each strategy (the
ZeRO paper's table). The formulas and the measuring registry are in
:mod:`ringcomm.train.accounting.memory`."""
import sys

from .train.accounting.memory import main

if __name__ == "__main__":
    sys.exit(main())
