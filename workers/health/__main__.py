"""``python -m eventbus.workers.health``."""

import sys

from eventbus.runtime.program_exit import without_final_collection
from eventbus.workers.health.cli import main

sys.exit(without_final_collection(main()))
