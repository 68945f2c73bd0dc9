"""``python -m eventbus.monitor``: the same command as ``eventbus monitor``."""

import sys

from eventbus.monitor.app import main

sys.exit(main())
