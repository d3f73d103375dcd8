"""``python -m hashattention.evaluation``: see :mod:`hashattention.evaluation.cli`."""

import sys

from .cli import main

sys.exit(main())
