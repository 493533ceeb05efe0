import logging
import os
import sys

from .cli import main
from .distributed.last_line import keep_last_line
from .distributed.launch import FINAL_EXITS, RUN_DIR_NOTE_ENV
from .records.launches import note_final

keep_last_line()  # a rank of stabletrain's torchrun launcher: for its agent, which reads no rank's output
code = main()
if code in FINAL_EXITS:  # stabletrain's own decision to end (a launcher restarts none): not a task's exit with that code
    note_final(os.environ.get(RUN_DIR_NOTE_ENV), code)
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # A torchrun rank whose command is over (its process group torn down, its files closed and its last checkpoint
    # waited for): the interpreter's teardown is skipped, where gloo's threads can abort the process after a
    # successful run ('terminate called without an active exception', SIGABRT; pytorch/pytorch#179291), rarely
    # and more often on a busy machine (seen once in seven runs of the suite, on an FSDP resume that had finished).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
