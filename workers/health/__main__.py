"""``python -m eventbus.workers.health``."""

import sys

from eventbus.workers.health.cli import main

sys.exit(main())
