"""``python -m ringcomm.selfcheck``: see :mod:`ringcomm.selfcheck`."""
import sys

from . import main

sys.exit(main())
