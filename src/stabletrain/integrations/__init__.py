"""Keep your trainer: stabletrain's sentinel, incidents and run directory as thin adapters over the same pieces.

- :class:`stabletrain.Monitor` (:mod:`stabletrain.integrations.monitor`): your own loop.
- :class:`stabletrain.integrations.lightning.StableTrainCallback`: a ``lightning.pytorch.Callback``.
- :class:`stabletrain.integrations.transformers.StableTrainCallback`: a ``transformers.TrainerCallback``.

What they share (:mod:`.core`): the run directory, device-side metrics reduced once per interval, the
guard, the loop's interval boundary and incident capture fed by the host's kept steps; their options are
:class:`~stabletrain.config.adapter.AdapterOptions`. The host modules import their trainer; this package, neither.
"""

from ..config import AdapterOptions
from ..errors import StopTraining
from .core import RunSession

__all__ = ["AdapterOptions", "RunSession", "StopTraining"]
