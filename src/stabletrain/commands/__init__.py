"""The subcommands of ``stabletrain`` that need more than a few lines (:mod:`stabletrain.cli` parses and dispatches)."""
