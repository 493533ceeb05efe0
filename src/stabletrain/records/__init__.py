"""The run's record: the run directory, event and metric keys, checkpoints, incident bundles, staging."""
