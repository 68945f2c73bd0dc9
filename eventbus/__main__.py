import sys

from eventbus.cli import main

sys.exit(main())
