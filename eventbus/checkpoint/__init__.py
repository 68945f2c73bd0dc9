"""Checkpoints: staged into shared memory by the trainer, written to files by the checkpoint worker."""
