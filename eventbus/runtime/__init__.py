"""The processes that follow a run: the callback host, workers, the main job, shared daemon plumbing."""
