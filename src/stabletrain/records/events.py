"""What a run directory's two logs may hold: every event kind and every metric key, with its meaning.

The one table of each (DESIGN.md, "Each fact once"). :meth:`stabletrain.records.rundir.RunDir.event` refuses
a kind missing here, the report reads its known kinds and keys from here, and a test checks the
docs' tables (docs/run-directory.md) against these. A new event or metric is added here first, with its meaning.

``events.jsonl`` holds one JSON object per event: ``{"step", "kind", "reason", "time", ...}`` where
``reason`` is one plain sentence and the other fields depend on the kind. ``metrics.jsonl`` holds
one JSON object per log interval, with the keys of :data:`METRIC_KEYS` (non-finite floats are
written as the strings "nan", "inf", "-inf").
"""

from __future__ import annotations

__all__ = ["EVENT_KINDS", "REPLAY_KINDS", "METRIC_KEYS"]

#: Event kind -> what it means (one line).
EVENT_KINDS: dict[str, str] = {
    "skip": "an optimizer step was not applied (non-finite loss/grad norm, fp16 overflow, or a spike under guard.on_spike=skip); "
            "parameters, optimizer state and LR untouched",
    "nonfinite": "a step had a non-finite loss, grad norm, input or (after the update) parameter; 'ranks' says where under DDP",
    "buffers_reset": "a skipped step's forward left the model's running statistics non-finite (a BatchNorm's, from a NaN "
                     "input): reset (mean 0, var 1), as no checkpoint could be written again; 'buffers' names them",
    "spike": "the loss rose above guard.spike_ratio x the recent median and guard.spike_zscore deviations above the mean "
             "(or robust deviations above the median, past guard.spike_ratio^2 x it: docs/loss-spikes.md)",
    "precursor": "a warning before a spike (guard.precursor): some layer's update/weight ratio departed from its own recent "
                 "history while the loss had not; 'layers' names each with its ratio, typical ratio, factor and z-score "
                 "(and its grad norm's)",
    "early_outlier": "one of a run's first losses, before the spike rule arms, was over spike_ratio**5 (32x) every loss "
                     "before it, or spike_ratio**10 (1024x) the median of those after it to step 5: said, not judged, "
                     "skipped or captured ('loss', 'factor')",
    "incident": "a bad step was captured into incidents/step_N (and diagnosed unless capture.diagnose=false), or could not be",
    "checkpoint": "a checkpoint was written, verified, and LAST_GOOD moved to it",
    "checkpoint_withheld": "no checkpoint was written because the state was not finite or was inside an incident; "
                           "LAST_GOOD stays",
    "checkpoint_failed": "writing a checkpoint failed (disk full, I/O error); the previous one and LAST_GOOD are untouched",
    "checkpoint_skipped": "on resume or rollback a checkpoint did not verify (truncated, corrupted, refused) "
                          "and an older one was used",
    "restart": "a process of the run died and the run restarted by itself (run.max_restarts, torchrun): the cause (exit code or "
               "signal, rank, its last line), what the launch before met, the checkpoint resumed from, the steps to train again, "
               "a checkpoint no longer trusted",
    "resume": "the run continued from a checkpoint at this step (metrics and events logged past it before are superseded; "
              "under another world size: resharded, with the old and new world size and global batch)",
    "rollback": "the guard rolled back to the last good checkpoint, skipping the offending data window",
    "remedy": "guard.on_nonfinite=remedy (or config key 'remedy.apply'): a remedy verified on a replay of the incident "
              "was applied (what, from which step, the evidence), or none cured it and the fallback was taken",
    "schedule_changed": "the LR schedule's horizon changed on resume (train.max_steps differs from the checkpoint's)",
    "stall": "the run is not learning: no update of the last guard.stall_steps steps moved the parameters (skipped, or applied "
             "with a zero gradient) and guard.on_stall=warn trains on; with on_stall=stop it is the stop's reason",
    "stop": "the run stopped before train.max_steps: a guard limit, SIGINT or SIGTERM, or a restart refused "
            "(the same failure again, run.max_repeats)",
    "crash": "an exception ended the run: its type, message and where in the user's code it was raised",
    "retry": "the host trainer trains again from its first step at a smaller batch after running out of memory "
             "(transformers' auto_find_batch_size): the run directory holds the new attempt",
    "init_overwritten": "parameters changed between the task factory and the first step (an init was overwritten)",
}

#: Events after which training continues from an earlier step: what was logged past that step is superseded.
REPLAY_KINDS: tuple[str, ...] = ("resume", "rollback", "remedy")  # a remedy with a rollback goes back to its step

#: Metric key (a line of metrics.jsonl) -> what it means. Every figure is global under DDP.
METRIC_KEYS: dict[str, str] = {
    "step": "optimizer steps taken at the end of the interval (a skipped step counts)",
    "loss": ("mean over the interval's finite steps of each step's unscaled per-item loss (a skipped step's too: a spike "
             "that guard.on_spike=skip skipped is in it, as num_spikes and loss_max say)"),
    "loss_min": "min over the interval of each step's unscaled per-item loss",
    "loss_steps": "the interval's steps with a finite loss: those loss, loss_min and loss_max are over",
    "loss_max": "max over the interval of each step's unscaled per-item loss",
    "grad_norm": "mean pre-clip global L2 grad norm over the interval's finite steps",
    "grad_norm_max": "max pre-clip global L2 grad norm over the interval's finite steps",
    "grad_norm_post_clip": "mean post-clip global L2 grad norm over the interval's finite steps",
    "clip_rate": "fraction of the interval's applied steps where clipping fired (a skipped step's gradients were discarded)",
    "update_norm": ("L2 norm of the update of the interval's last step, ||theta_t - theta_{t-1}|| ('nan' when that step was "
                    "skipped: it made no update, or where it was not measured)"),
    "update_ratio": "update_norm / parameter norm at that step",
    "lr": "learning rate after the interval's last step",
    "loss_scale": "GradScaler scale after the interval's last step (1.0 without a scaler)",
    "num_skipped": "steps whose update was skipped in the interval (non-finite, overflow, spike)",
    "num_nonfinite": "steps with a non-finite loss, grad norm or (after the update) parameter in the interval",
    "num_spikes": "loss spikes in the interval (rule: stabletrain.policies.guard)",
    "num_incidents": "intervals with an incident (non-finite steps or loss spikes) so far in the run",
    "num_rollbacks": "rollbacks so far in the run",
    "tokens_per_s": "tokens per second over the interval's wall time (tokens = items a (sum, count) loss counts)",
    "samples_per_s": "samples per second over the interval's wall time",
    "step_time_s": "mean wall time per optimizer step in the interval",
    "peak_memory_mib": "CUDA max allocated, or the process's peak RSS on CPU",
    "epoch": "data epoch at the end of the interval",
    "samples_seen": "samples trained on so far",
    "tokens_seen": "tokens (items the loss counts) trained on so far",
    "top_grad_layers": "the parameters with the largest share of the squared grad norm over the interval: [{name, share}]",
    "top_update_layers": "the parameters with the largest update/weight ratio ||update|| / ||theta|| "
                         "at the interval's last step: [{name, ratio}]",
    "val_loss": "validation loss per item, every eval.every steps and at the end",
    "val_step": "an adapter's: the step its host's evaluation (val_loss) measured, in the next interval's record (the "
                "run's last, where none follows)",
    "world_size": "processes training together (DDP and FSDP runs only)",
}
