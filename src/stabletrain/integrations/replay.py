"""Old incident bundles name ``stabletrain.integrations.replay:captured_task`` as their task: it is
:func:`stabletrain.records.captured.captured_task` now (with the batch formats in :mod:`stabletrain.records.batches`)."""

from ..records.captured import captured_task

__all__ = ["captured_task"]
