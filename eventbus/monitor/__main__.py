import sys

from eventbus.monitor.dashboard import main

sys.exit(main())
