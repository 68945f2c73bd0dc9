"""Where a run's metrics go: files, TensorBoard, MLflow, ... (each a LoggerDestination).

A daemon hosts them on the live stream (``python -m eventbus.workers.logger``) and
``eventbus export`` writes a journal into them; neither touches the trainer.
Imported lazily: a tracker's own package is needed only when it is used. Each
writes into the run's folder (:func:`eventbus.core.run_folder.announced_run_folder`).
"""
