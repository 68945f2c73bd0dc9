import sys

from eventbus.cli import command

sys.exit(command())
