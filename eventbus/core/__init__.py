"""Composer's vocabulary shared by the training process and the subscribers; imports no torch."""
