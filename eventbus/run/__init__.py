"""``eventbus run``: the demo trainer and its daemons as one command, in one module per responsibility.

``config`` -- :class:`JobConfig` (the options, also the config-file keys), the
    command line, TOML/YAML files and every check made before anything starts.
``resume`` -- a new run's folder and name; the run to resume and its latest
    checkpoint, here or in the remote save folder.
``supervise`` -- the daemons as child processes: command lines, start, wait, stop.
``summary`` -- the closing lines, with an address a client can dial.
``job`` -- :func:`run_job`: the trainer assembled from the config, trained with its daemons.
``daemons`` -- ``eventbus daemons``: the same daemons for a run started elsewhere.

Importing this package imports none of them (``eventbus --help`` stays fast).
"""
