"""The daemons users run beside the trainer; each module holds its callbacks and a ``main``.

* ``logger``     -- console progress, metrics.jsonl / metrics.csv, TensorBoard, MLflow.
* ``timing``     -- SpeedMonitor, RuntimeEstimator, LRMonitor, OptimizerMonitor, MemoryMonitor.
* ``checkpoint`` -- CheckpointSaver: writes the checkpoints the trainer staged.
* ``health``     -- SystemMonitor, StallDetector, LossMonitor: the machine, hangs and the loss, from outside.
* ``stoppers``   -- EarlyStopper, ThresholdStopper, stopping the trainer over the control channel.

Every callback here is an ordinary ``eventbus.Callback``: it works in process
too (``Trainer(callbacks=[...])``), where ``state`` is the live State.
"""
