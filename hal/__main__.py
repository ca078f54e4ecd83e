"""``python -m hal`` is the ``hal`` command."""
import sys

from hal.cli import main

sys.exit(main())
