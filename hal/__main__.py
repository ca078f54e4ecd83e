"""``python -m hal`` is the ``hal`` command."""
import sys

from .cli import main

sys.exit(main())
