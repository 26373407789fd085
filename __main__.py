"""``python -m kiln`` is the ``kiln`` command."""
import sys

from kiln.cli import main

sys.exit(main())
