"""``python -m napkin.bench FILE ...``: the benchmark without the napkin CLI."""
import sys

from .harness import main

sys.exit(main())
