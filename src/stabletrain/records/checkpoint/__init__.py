"""Checkpoints that are never written from a bad state and never leave a run without a good one.

Layout (DESIGN.md, "Run directory")::

    RUN_DIR/checkpoints/
        step_000100/state.pt    the whole state (``Trainer.state_dict()``); loads with torch.load(weights_only=True)
        step_000100/meta.json   step, time, CRC32 and size of state.pt, versions, and the caller's meta (config)
        step_000100/dcp/        FSDP2 only: each rank's shards of the model and optimizer (torch.distributed.checkpoint)
        LAST_GOOD               one line: the name of the newest verified checkpoint directory

One save (DESIGN.md, principle 4: nothing bad is persisted)::

    check the model and optimizer state are finite    # one fused pass, one host read; else write nothing
    [save_async: stage a copy into a reused shared-memory block; training goes on, the writer process does the rest]
    write step_000100.tmp-<pid>/state.pt, meta.json   # each with fileio.atomic_write: fsynced, then the directory
    verify the temporary copy                         # size, pickle admitted by weights_only=True (a load: CRC32, finite)
    rename it to step_000100                          # an existing step_000100 is moved aside, deleted last
    point LAST_GOOD at it                             # tmp file, fsync, os.replace, fsync of the directory
    prune to the ``keep`` newest                      # never the one LAST_GOOD names

The parts: :mod:`.files` (one directory's files: the finiteness check, writing with a checksum, safe
loading, what a good checkpoint is), :mod:`.saves` (what a save returns, a save in flight, what it cost
training), :mod:`.manager` (:class:`~.manager.CheckpointManager`: LAST_GOOD, saving, debris, pruning,
rollback and loading with fallback), the background save's parts (:mod:`.arena`: the shared-memory
staging; :mod:`.background`: the hand-over; :mod:`.writer` and :mod:`.writer_main`: the writer process,
both ends) and :mod:`.shards` (the DCP folder of a sharded checkpoint: save, verify, load; its process-based
asynchronous save: :mod:`.dcp_process`).
"""
