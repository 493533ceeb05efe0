"""What the loop drives by name: the checkpoint keeper, the incident recorder, the signal handler."""
