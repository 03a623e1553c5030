"""Loss scaling in torch: the core's scaler with ``GradScaler``'s API, the step's check, what a skip holds.

The concept (the core's :mod:`mp_callbacks.loss_scale`): the loss is multiplied by a scale before the
backward; after it every gradient is checked for inf/NaN and unscaled; a step whose gradients are not
finite is skipped (nothing the model learns from changes) and the scale moves by the core's one transition
(:func:`mp_callbacks.loss_scale.next_state`).  The rules here:

* :class:`TorchLossScaler` holds the state in 0-d tensors on the training device, moved only by
  ``next_state`` over :class:`~lightning_ext.ops.TorchOps`; its check and unscale is torch's fused AMP kernel
  as ``GradScaler`` calls it (:func:`unscale_and_check`); the step's decision is one host read of
  ``found_inf`` where the step can be skipped (:meth:`TorchLossScaler.skips`); recipes without loss scaling
  check too and skip non-finite steps unless ``skip_nonfinite=False``.
* :class:`ExternalScaler`: a user's object with ``GradScaler``'s API, driven as Lightning drives it
  (``16-mixed`` only).
* :class:`TorchDivergence`: the core's divergence rule at the step decision (the run stops early when it
  cannot recover).
* :class:`ForwardState`: the buffers the forward writes (BatchNorm statistics) put back on a skipped step.
* :class:`HeldScheduler`: step-interval LR schedulers do not advance on a skipped step.
"""

from .divergence import TorchDivergence
from .external import ExternalScaler
from .forward_state import ForwardState
from .scaler import OptState, TorchLossScaler, scaler_config_from, unscale_and_check, unwrap_optimizer
from .schedulers import HeldScheduler, hold_schedulers

__all__ = ["ExternalScaler", "ForwardState", "HeldScheduler", "OptState", "TorchDivergence", "TorchLossScaler",
           "hold_schedulers", "scaler_config_from", "unscale_and_check", "unwrap_optimizer"]
