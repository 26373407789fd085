"""``python -m kiln.runtime model.kiln --input x=x.npy [-o out.npz] [--repeat N]``: the same as
``kiln run``, with nothing but numpy and kiln's runtime imported."""
import sys

from kiln.runtime.cli import main

sys.exit(main())
