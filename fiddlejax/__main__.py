"""``python -m fiddlejax``: the ``fiddlejax`` command, for environments without its script on
``PATH`` (a launcher that runs ``python -m``, an unactivated virtual environment)."""

import sys

from fiddlejax.cli import main

if __name__ == "__main__":  # importing it (a module scan) runs nothing
    sys.exit(main())
