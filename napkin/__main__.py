"""``python -m napkin``: the same command line as the ``napkin`` script."""
import sys

from .cli import main

sys.exit(main())
