"""``python -m raysync``: the same as the ``raysync`` command (see :mod:`raysync.cli`)."""

import sys

from raysync.cli import main

if __name__ == "__main__":
    sys.exit(main())
