"""``python -m fiddlejax``: the ``fiddlejax`` command, for environments without its script on
``PATH`` (a launcher that runs ``python -m``, an unactivated virtual environment)."""

import sys

from fiddlejax.cli import main

sys.exit(main())
