"""``bf16-kahan`` and ``bf16-sr`` in Keras: the user's optimizer, bf16 variables, no FP32 masters.

The core's rules
(:mod:`mp_callbacks.weights`) decide how an update is written into a bf16
variable; :class:`UpdateRounding` takes the place of
:class:`~keras_ext.weights.masters.MasterWeights` inside :class:`keras_ext.LossScaleOptimizer`
so that the wrapped optimizer (AdamW, SGD with momentum, any Keras optimizer
whose ``update_step`` writes through ``self.assign*``) computes each update in
FP32 with FP32 slots:

* the inner optimizer is built on a *working variable* per bf16 variable
  (:class:`WorkingVariable`: shape, name and path of the variable, dtype
  ``float32``, no storage of its own), so its slots are FP32 (``state_dtype``
  ``bfloat16``: bf16 slots, Keras' own arithmetic on them);
* each applied step gives every working variable an FP32 value for the
  duration of the step (``f32(w) + f32(c)`` under Kahan, ``f32(w)`` under SR),
  the inner optimizer's ordinary ``apply`` (weight decay, clipping, its
  ``update_step``, ``iterations``) updates it, and the rule writes the result
  back (:func:`~mp_callbacks.weights.rounding.kahan_apply` /
  :func:`~mp_callbacks.weights.rounding.stochastic_round`); the value is dropped;
* persistent state: a compensation buffer per bf16 variable under Kahan (in the
  variable's dtype), the stream's ``seed`` and update ``counter``: variables of
  the optimizer, so ``model.save`` / ``save_weights`` / ``load_model`` carry them;
* a step therefore holds the core estimate (bf16 weights and gradients,
  compensation, slots: :func:`mp_callbacks.memory.estimate.estimate_memory`) in variables,
  plus the step's FP32 temporaries inside the traced function;
* for the swamping meter (``mp/update_swamped_frac``, as Lightning's: the FP32
  update the optimizer asked for, against the bf16 weight), a monitor turns on
  :meth:`UpdateRounding.track_updates`: each applied step keeps the sampled FP32
  values and updates in small variables outside the optimizer (not saved);
* stochastic rounding draws the core's counter-based stream: the tensor index
  is the variable's position in the optimizer's variable list, the element
  index the canonical (torch) layout's (kernels through
  :func:`~mp_callbacks.weights.random_source.keras_kernel_to_canonical`), so Lightning and
  Keras draw the same number for corresponding elements; each variable's rule is one compiled kernel over
  :class:`~keras_ext.weights.KerasRoundingOps` (:mod:`keras_ext.weights.rounding_ops`).

The optimizer calls :meth:`UpdateRounding.write_back` only on applied steps
(inside its ``ops.cond``): a skipped step leaves weights, compensation,
counter, slots and ``iterations`` as they were.  Works in ``tf.function``,
under XLA and on Keras' torch backend; one replica only (a ``tf.distribute``
strategy with several replicas is refused at build).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from mp_callbacks.weights import MASK32, MasterPlan, initial_compensation

from ..ops import dtype_name, is_tf, sample
from . import rounding_ops as fused
from .masters import LOW_PRECISION, _label
from .rounding_ops import KERAS_ROUNDING_OPS, canonical_perm

__all__ = ["UpdateRounding", "WorkingVariable"]


class WorkingVariable:
    """What the inner optimizer updates in place of a bf16 variable: an FP32 value during a step.

    It is built on (slots are created from its shape, name, path and dtype) and keyed like a variable;
    :attr:`value` holds the step's FP32 tensor, which the optimizer's ``assign``/``assign_add``/
    ``assign_sub`` (and weight decay's arithmetic) replace.  No storage between steps.
    """

    _count = 0

    def __init__(self, variable: Any, dtype: str = "float32") -> None:
        WorkingVariable._count += 1
        self.shape = tuple(variable.shape)
        self.name = getattr(variable, "name", "var")
        self.path = getattr(variable, "path", None) or self.name
        self.dtype = dtype
        self.trainable = True
        self.constraint = None
        self.overwrite_with_gradient = False
        self._layout = None
        self._unique_id = f"keras_ext_working_{WorkingVariable._count}"  # TensorFlow's optimizer key
        self.value: Any = None
        self.start: Any = None  # the swamping meter's sample of the step's value before the update

    def assign(self, value: Any) -> WorkingVariable:
        self.value = ops.cast(value, "float32")
        return self

    def assign_add(self, value: Any) -> WorkingVariable:
        return self.assign(ops.add(self.value, ops.cast(value, "float32")))

    def assign_sub(self, value: Any) -> WorkingVariable:
        return self.assign(ops.subtract(self.value, ops.cast(value, "float32")))

    def numpy(self) -> Any:
        return ops.convert_to_numpy(self.value)

    def __mul__(self, other: Any) -> Any:
        return ops.multiply(self.value, other)

    __rmul__ = __mul__

    def __add__(self, other: Any) -> Any:
        return ops.add(self.value, other)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        return ops.subtract(self.value, other)

    def __rsub__(self, other: Any) -> Any:
        return ops.subtract(other, self.value)

    def __truediv__(self, other: Any) -> Any:
        return ops.divide(self.value, other)

    def __neg__(self) -> Any:
        return ops.negative(self.value)

    def __repr__(self) -> str:
        return f"<WorkingVariable path={self.path!r} shape={self.shape} dtype={self.dtype}>"


def _register_tf_conversion() -> None:
    """TensorFlow: a :class:`WorkingVariable` converts to its value (``ops.*`` accept it, as a variable)."""
    import tensorflow as tf

    def convert(value: WorkingVariable, dtype: Any = None, name: Any = None, as_ref: bool = False) -> Any:
        return tf.convert_to_tensor(value.value, dtype=dtype, name=name)

    tf.register_tensor_conversion_function(WorkingVariable, convert)


if is_tf():
    _register_tf_conversion()


class UpdateRounding:
    """Kahan-compensated or stochastically rounded updates of bf16 variables, around the inner optimizer.

    The same interface as :class:`~keras_ext.weights.masters.MasterWeights` (``build``, ``targets``,
    ``write_back``, ``variables``, ``enabled``: False, there are no masters), which
    :class:`keras_ext.LossScaleOptimizer` drives.

    Args:
      plan: the recipe's :class:`~mp_callbacks.memory.estimate.MasterPlan` (``update_rounding`` ``kahan`` or
        ``stochastic``; ``state_dtype``).
      seed: the stochastic-rounding seed (an integer >= 0, used mod ``2**32``); a checkpoint's wins.
    """

    enabled = False  # no FP32 masters

    def __init__(self, plan: MasterPlan, seed: int = 0) -> None:
        if not plan.rounds_updates:
            raise ValueError(f"UpdateRounding needs update_rounding 'kahan' or 'stochastic', "
                             f"not {plan.update_rounding!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"stochastic rounding seed={seed!r} must be an integer >= 0")
        self.plan, self.mode, self.seed = plan, plan.update_rounding, seed
        self._working: list[WorkingVariable | None] = []
        self._comp: list[Any] = []
        self._counter: Any = None
        self._seed: Any = None
        self._position: dict[int, int] = {}
        self._tracked: dict[int, tuple[Any, Any]] | None = None  # index -> (FP32 before, FP32 update) samples
        self._samples: int | None = None

    @property
    def kahan(self) -> bool:
        """True under Kahan compensation (else stochastic rounding)."""
        return self.mode == "kahan"

    @property
    def variables(self) -> list[Any]:
        """No masters: ``None`` for every variable (each is its own master)."""
        return [None] * len(self._working)

    @property
    def compensation_variables(self) -> list[Any]:
        """The compensation buffers, aligned with the optimizer's variables (None: not rounded, or SR)."""
        return list(self._comp)

    @property
    def working_variables(self) -> list[WorkingVariable | None]:
        """What the inner optimizer updates in place of each variable (None: the variable itself)."""
        return list(self._working)

    @property
    def counter(self) -> int:
        """Updates applied so far (the stream's step; one host read)."""
        return int(ops.convert_to_numpy(self._counter))

    @property
    def stream_seed(self) -> int:
        """The stream's seed (after a checkpoint load: the checkpoint's; one host read)."""
        return int(ops.convert_to_numpy(self._seed))

    def check_inner(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Refuse (``ValueError`` naming the option) inner-optimizer options the working values cannot carry:
        ``use_ema`` (the averages of the FP32 working values would never reach the bf16 variables) and
        ``gradient_accumulation_steps`` (the inner optimizer updates inside its own ``cond``, out of the
        rule's reach; a step that only accumulates would still round and advance the stream)."""
        given = [f"{name}={value!r}" for name, value in (("use_ema", getattr(optimizer, "use_ema", False)),
                 ("gradient_accumulation_steps", getattr(optimizer, "gradient_accumulation_steps", None)))
                 if value]
        if given:
            raise ValueError(f"recipe update rounding {self.mode!r} (bf16-kahan/bf16-sr) does not support "
                             f"{' and '.join(given)} on the inner optimizer {type(optimizer).__name__}; "
                             "use 'bf16-master' (FP32 masters) for it, or leave the option off")

    # -------------------------------------------------------------- build
    def build(self, optimizer: keras.optimizers.Optimizer, var_list: Sequence[Any]) -> list[Any]:
        """Create the compensation buffers, the stream's variables and the working variables on ``optimizer``;
        return what the inner optimizer is built on (the working variable, or the FP32 variable itself)."""
        if is_tf():
            import tensorflow as tf

            if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
                raise NotImplementedError(f"recipe update rounding {self.mode!r} runs on one replica only (no "
                                          "tf.distribute strategy with several replicas yet); use 'bf16-master'")
        self._seed = optimizer.add_variable(shape=(), dtype="int64", name="rounding_seed", aggregation="none",
                                            initializer=keras.initializers.Constant(self.seed & MASK32))
        self._counter = optimizer.add_variable(shape=(), dtype="int64", name="rounding_counter",
                                               aggregation="none", initializer="zeros")
        self._working, self._comp = [], []
        self._position = {id(v): i for i, v in enumerate(var_list)}
        for v in var_list:
            dtype = dtype_name(v)
            if dtype not in LOW_PRECISION:
                self._working.append(None)
                self._comp.append(None)
                continue
            if not self.kahan and dtype != "bfloat16":
                raise ValueError(f"stochastic rounding writes bfloat16; variable {_label(v)!r} is {dtype}")
            working = WorkingVariable(v, dtype="float32" if self.plan.quantized_states else self.plan.state_dtype)
            working.value = v  # until the first step: what TensorFlow colocates the slots with
            self._working.append(working)
            self._comp.append(optimizer.add_variable(shape=v.shape, dtype=dtype, initializer="zeros",
                                                     aggregation="none", name=f"{_label(v)}_compensation")
                              if self.kahan else None)
        targets = [v if w is None else w for v, w in zip(var_list, self._working)]
        return targets

    def start_from(self, variable: Any, fp32_value: Any) -> None:
        """Set ``variable`` (one the optimizer was built on) to the rounding of ``fp32_value``; under Kahan its
        compensation starts with the rounding error (``low(x - f32(w))``), as Lightning's plugin does with the
        model's FP32 values (a model built in low precision starts with no compensation)."""
        x = ops.cast(ops.convert_to_tensor(fp32_value), "float32")
        variable.assign(ops.cast(x, variable.dtype))
        comp = self._comp[self._position[id(variable)]] if self._comp else None
        if comp is not None:
            comp.assign(initial_compensation(x, variable.value, KERAS_ROUNDING_OPS))

    def track_updates(self, on: bool, samples: int | None = None) -> None:
        """Keep (``on``), at every applied step, each rounded variable's FP32 value before the step and the FP32
        update on the elements :func:`~keras_ext.diagnostics.meters.sample` reads (``samples``): the swamping meter's
        input (:meth:`tracked_updates`).  Retrace the step after switching."""
        if not on:
            self._tracked = None
            return
        self._samples, self._tracked = samples, {}
        for i, w in enumerate(self._working):
            if w is not None:
                n = int(sample(ops.zeros(w.shape, dtype="int8"), samples).shape[0])
                self._tracked[i] = tuple(keras.Variable(ops.zeros((n,)), dtype="float32", trainable=False,
                                                        name=f"{_label(w)}_{what}") for what in ("before", "update"))

    def tracked_updates(self) -> list[tuple[Any, Any, str]]:
        """``(sampled FP32 value before the last applied step, its FP32 update, storage dtype)`` per rounded
        variable (empty unless :meth:`track_updates` is on)."""
        return [(b, u, "bfloat16") for b, u in (self._tracked or {}).values()]

    # --------------------------------------------------------------- step
    def targets(self, grads: Sequence[Any], tvs: Sequence[Any],
                index: Callable[[Any], int]) -> tuple[list[Any], list[Any]]:
        """``(grads, targets)`` for the inner optimizer: each rounded variable's working variable, holding
        ``f32(w) + f32(c)`` (Kahan) or ``f32(w)`` (SR) for this step, with its gradient in FP32."""
        out_grads, out_targets = [], []
        for g, v in zip(grads, tvs):
            i = index(v)
            w = self._working[i]
            if w is None:
                out_grads.append(g)
                out_targets.append(v)
                continue
            comp = self._comp[i]
            w.dtype = "float32"  # built in the state dtype (the slots'); computes in FP32
            if g is None:  # not updated (the inner optimizer skips it): nothing to write back
                w.value = w.start = None
            else:
                w.value = (fused.compensated(v.value, comp.value) if comp is not None
                           else ops.cast(v.value, "float32"))
                # the meter's sample of the value before the update (a copy: torch's optimizers work in place)
                w.start = ops.copy(sample(w.value, self._samples)) if self._tracked is not None else None
                g = ops.cast(g, "float32")
            out_grads.append(g)
            out_targets.append(w)
        return out_grads, out_targets

    def write_back(self, tvs: Sequence[Any], index: Callable[[Any], int]) -> None:
        """The rule: ``w, c <- kahan_apply(w, c, t)`` or ``w <- stochastic_round(t)`` for every rounded
        variable the inner optimizer updated; then the stream's counter advances."""
        step = None
        for v in tvs:
            i = index(v)
            w = self._working[i]
            if w is None or w.value is None:
                continue
            t_new, start, w.value, w.start = w.value, w.start, None, None
            if self._tracked is not None and i in self._tracked and start is not None:
                before, update = self._tracked[i]
                before.assign(start)
                update.assign(ops.subtract(sample(t_new, self._samples), start))
            comp = self._comp[i]
            if comp is not None:
                new, c = fused.kahan(v.value, comp.value, t_new)
                comp.assign(c)
            else:
                if step is None:
                    step = ops.cast(self._counter.value, "int32"), ops.cast(self._seed.value, "int32")
                new = fused.stochastic(t_new, step[1], i, step[0], canonical_perm(v))
            v.assign(new)
        self._counter.assign_add(ops.convert_to_tensor(1, dtype="int64"))
