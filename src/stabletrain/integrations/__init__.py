"""Keep your trainer: stabletrain's sentinel, incidents and run directory as thin adapters over the same pieces.

- :class:`stabletrain.Monitor` (:mod:`stabletrain.monitor`): your own loop.
- :class:`stabletrain.integrations.lightning.StableTrainCallback`: a ``lightning.pytorch.Callback``.
- :class:`stabletrain.integrations.transformers.StableTrainCallback`: a ``transformers.TrainerCallback``.

What they share (:mod:`.core`): the run directory, device-side metrics reduced once per interval, the
guard with its capture hold, incident bundles and their diagnosis; :mod:`.replay` rebuilds a captured
step so that ``stabletrain diagnose`` replays it in a new process. The host-specific modules import their
trainer; importing this package imports neither.
"""

from .core import RunSession
from .options import AdapterOptions, StopTraining

__all__ = ["AdapterOptions", "RunSession", "StopTraining"]
