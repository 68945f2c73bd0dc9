"""``python -m workers.monitor``: kept as an alias of ``eventbus monitor``."""

import sys

from eventbus.monitor.app import main

if __name__ == "__main__":
    sys.exit(main())
