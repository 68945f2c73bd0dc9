"""``python -m workers.health``."""

import sys

from workers.health.cli import main

sys.exit(main())
