"""``python -m erlay.supervisor.cli``: the ``erlay`` command without its console script."""

import sys

from erlay.supervisor.cli import main

sys.exit(main())
