"""``python -m ringcomm.launch``: see :mod:`ringcomm.launch`."""
import sys

from .workers import main

sys.exit(main())
