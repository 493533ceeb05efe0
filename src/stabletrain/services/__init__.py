"""What the loop drives by name: the checkpoint keeper, the incident recorder, the remedy applier, the signal handler.

A service is not a callback: the loop calls its methods where the run needs them and gets their results
back (a callback only observes and reacts through hooks). A service that saves, restores or replays the
run's state holds the run's :class:`~stabletrain.runstate.RunState` (its parts, their state dicts and its
step), the same object the callbacks are handed; never the trainer.
"""
