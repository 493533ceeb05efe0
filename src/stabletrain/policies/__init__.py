"""The step's policies: precision, accumulation, clipping, guard, metrics, LR schedule, optimizer."""
