"""``eventbus monitor``: the live terminal dashboard for a running or finished run."""
