"""Whether an error is a lost peer: a collective that failed because another rank exited, hung or is unreachable.

:class:`PeerLostError` is the one line the run ends with then; :func:`is_peer_failure` tells such a failure
from the user's own errors by where it arose, never by its message.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

from ..errors import short_cause
from .launch import RUN_DIR_NOTE_ENV, resume_command

__all__ = ["PeerLostError", "is_peer_failure", "short_cause"]


class PeerLostError(RuntimeError):
    """A collective failed: another rank exited, crashed or did not answer within ``dist.timeout_s``."""

    def __init__(self, rank: int, where: str, step: int, last_good: str | None, cause: str,
                 run_dir: str | None = None) -> None:
        self.rank, self.where, self.step, self.last_good, self.cause = rank, where, step, last_good, cause
        saved = (f"no checkpoint was written after {last_good} (LAST_GOOD)" if last_good else "no checkpoint was written")
        done, most = (int(os.environ.get(k, "0") or 0) for k in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"))
        self.restarts, ours = done < most, bool(os.environ.get(RUN_DIR_NOTE_ENV))  # (ours: stabletrain's launcher)
        # under stabletrain's own launcher its restart line quotes this one (its cause): the rank says nothing itself
        self.quiet = self.restarts and ours
        if self.restarts:  # torchrun's agent restarts the ranks: no one needs to resume by hand
            key = "run.max_restarts" if ours else "torchrun's --max-restarts"
            hint = (f"; the launch restarts from {'LAST_GOOD' if last_good else 'step 0'} (restart {done + 1} of {most}, "
                    f"{key}), unless the same failure keeps coming back (run.max_repeats)")
        else:
            hint = f"; resume with: {resume_command(run_dir)}" if run_dir and last_good else ""
        super().__init__(f"rank {rank}: another rank exited or became unreachable during {where} after step {step}; "
                         f"{saved}{hint} ({short_cause(cause)})")


_DIST_DIR = os.path.dirname(dist.__file__) + os.sep
_ENGINE_FILE = os.path.normcase(os.path.abspath(torch.autograd.graph.__file__))
_DDP_FILE = os.path.normcase(os.path.abspath(torch.nn.parallel.distributed.__file__))
#: DDP's own functions that run a collective in its forward (its buffers' broadcast, its grad-sync agreement): a gloo
#: failure there (a plain RuntimeError from the C++ call) is the collective's.
_DDP_COLLECTIVES = frozenset({"_distributed_broadcast_coalesced", "_default_broadcast_coalesced", "_sync_module_buffers",
                              "_check_global_requires_backward_grad_sync", "_find_common_rank"})
#: Where gloo's transport raises (its C++ source, in the message): inside DDP's ``_pre_forward`` the reducer's bucket
#: rebuild both broadcasts (a lost peer: gloo's error) and raises the user's unused-parameter error, on one line.
_GLOO_TRANSPORT = "gloo/transport/"


def is_peer_failure(err: BaseException, *, in_gradient_sync: bool = False) -> bool:
    """Return whether ``err`` is a collective failing for want of a peer (another rank exited, hung, is unreachable).

    Decided from the exception's type, where it arose and the process group's state, never from its
    message (a ``DataLoader timed out`` or a user's own "connection reset" is not a lost peer):

    - no process group is initialized: False;
    - a :class:`torch.distributed.DistError` (``DistBackendError``: NCCL's failed or timed-out
      collectives; ``DistNetworkError``; ``DistStoreError``): c10d's own types for a failed communication;
    - a plain ``RuntimeError`` (gloo's failures are exactly that) raised inside a collective: its
      innermost frame is in ``torch.distributed`` (an explicit collective, FSDP's, DCP's) or in one of DDP's forward
      collectives (:data:`_DDP_COLLECTIVES`: a peer that died during a forward's buffer broadcast; in its
      ``_pre_forward``, where the same line raises a user's unused-parameter error, only gloo's transport error), or it came out
      of the autograd engine while DDP waited on its gradient all-reduce, after the backward's graph had
      run (``in_gradient_sync``: :attr:`WindowCarrier.in_gradient_sync`). An error of the graph itself
      (an in-place modification, a user's backward) arises before that and is the user's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if isinstance(err, dist.DistError):
        return True
    if type(err) is not RuntimeError or err.__traceback__ is None:
        return False
    frame = traceback.extract_tb(err.__traceback__)[-1]
    innermost = os.path.normcase(os.path.abspath(frame.filename))
    return (innermost.startswith(os.path.normcase(_DIST_DIR)) or (in_gradient_sync and innermost == _ENGINE_FILE)
            or (innermost == _DDP_FILE and (frame.name in _DDP_COLLECTIVES or _GLOO_TRANSPORT in str(err))))
