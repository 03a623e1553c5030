"""Loss scaling in Keras: the scaler state in variables, the step's finite check, the divergence rule, what a
skipped step leaves as it was.

The decisions are the core's (:mod:`mp_callbacks.loss_scale`, :mod:`mp_callbacks.diagnostics`); here they run
on Keras variables with ``keras.ops``, inside the traced step, with no host read:

* :class:`KerasLossScaler`: the scaler state (scale, growth tracker, hysteresis, counters) as optimizer variables
  (saved, restored and mirrored with it), moved only by the core's :func:`~mp_callbacks.loss_scale.next_state`;
  :func:`scaler_config` turns a ``LossScaleOptimizer``'s arguments into a config;
* :func:`found_inf` (one flag over every gradient), :func:`unscale`, :func:`scaled_loss`;
* :class:`KerasDivergence`: the core's divergence rule with its streaks and stop latch on the device, and its
  host check after each train step;
* :func:`restore_on_skip`: a skipped step leaves what the forward pass wrote (BatchNorm's moving statistics);
* :class:`StepState`: the variables the step writes besides the optimizer's saved state (JAX threads them).

A skipped step changes nothing the model learns from: variables, masters, slots and the inner optimizer's
``iterations`` stay bit for bit.
"""

from .check import found_inf, scaled_loss, unscale
from .divergence import LATCH_KEY, VARIABLES, KerasDivergence
from .forward_state import forward_state, restore_on_skip
from .scaler import VARIABLE_NAMES, KerasLossScaler, scaler_config
from .step_state import StepState

__all__ = [
    "LATCH_KEY",
    "VARIABLES",
    "VARIABLE_NAMES",
    "KerasDivergence",
    "KerasLossScaler",
    "StepState",
    "forward_state",
    "found_inf",
    "restore_on_skip",
    "scaled_loss",
    "scaler_config",
    "unscale",
]
