"""More than one process: the DDP context and carrier, FSDP2, sharded checkpoints."""
