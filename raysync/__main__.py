"""``python -m raysync``: the same as the ``raysync`` command (see :mod:`raysync.ops.cli`)."""

import sys

from raysync.ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
