"""8-bit block-quantized Adam states in Keras (``state_dtype="8bit"``): the core's rule over ``keras.ops``.

:class:`AdamW8bit` holds Adam's m and v of every variable that
:func:`~mp_callbacks.weights.low_bit.quantizes` as torchao's ``AdamW8bit`` does: uint8 codes of the
variable's shape, a float32 scale per block of 256 and the 256-entry float32 map (signed for m, unsigned
for v); smaller variables keep FP32 m and v.  Each step dequantizes, runs the core's
:func:`~mp_callbacks.weights.low_bit.adam_step_8bit` (torchao's formula: ``eps`` is added to
``sqrt(v) / sqrt(1 - b2**t)``), requantizes, and updates the variable from the unquantized m and v.
Weight decay is decoupled (Keras' own for Adam and AdamW alike), ``p -= (lr * wd) * p`` inside the step.
:func:`eight_bit_inner` is what the recipe knob does to the inner optimizer.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from mp_callbacks.weights import (
    BLOCK_SIZE,
    MasterPlan,
    adam_step_8bit,
    dequantize_8bit,
    dynamic_map,
    quantize_8bit,
    quantizes,
)

__all__ = ["KERAS_QUANT_OPS", "AdamW8bit", "KerasQuantOps", "eight_bit_inner"]


class KerasQuantOps:
    """:class:`mp_callbacks.weights.low_bit.QuantOps` over ``keras.ops`` (any backend, traced or eager)."""

    def f32(self, x: Any) -> Any:
        return ops.cast(x, "float32")

    def blocks(self, x: Any, block_size: int) -> Any:
        return ops.reshape(x, (-1, block_size))

    def reshape_like(self, x: Any, like: Any) -> Any:
        return ops.reshape(x, tuple(like.shape))

    def row_absmax(self, xb: Any) -> Any:
        return ops.max(ops.abs(xb), axis=-1)

    def div_rows(self, xb: Any, s: Any) -> Any:
        return ops.divide(xb, ops.expand_dims(s, -1))

    def mul_rows(self, xb: Any, s: Any) -> Any:
        return ops.multiply(xb, ops.expand_dims(s, -1))

    def maximum(self, a: Any, b: Any) -> Any:
        return ops.maximum(a, b)

    def ge(self, a: Any, b: Any) -> Any:
        return ops.greater_equal(a, b)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return ops.where(cond, a, b)

    def take(self, table: Any, index: Any) -> Any:
        return ops.take(table, index)

    def zeros_i32(self, like: Any) -> Any:
        return ops.zeros(tuple(like.shape), dtype="int32")

    def add(self, a: Any, b: Any) -> Any:
        return ops.add(a, b)

    def sub(self, a: Any, b: Any) -> Any:
        return ops.subtract(a, b)

    def mul(self, a: Any, b: Any) -> Any:
        return ops.multiply(a, b)

    def div(self, a: Any, b: Any) -> Any:
        return ops.divide(a, b)

    def sqrt(self, a: Any) -> Any:
        return ops.sqrt(a)

    def pow(self, base: float, exponent: Any) -> Any:
        return ops.power(ops.convert_to_tensor(base, dtype="float32"), exponent)

    def to_codes(self, index: Any) -> Any:
        return ops.cast(index, "uint8")

    def from_codes(self, codes: Any) -> Any:
        return ops.cast(codes, "int32")


KERAS_QUANT_OPS = KerasQuantOps()


@keras.saving.register_keras_serializable(package="keras_ext")
class AdamW8bit(keras.optimizers.Optimizer):
    """Adam with decoupled weight decay whose m and v are held 8-bit block-quantized (the core's rule).

    Registered with Keras' serialization (``keras_ext>AdamW8bit``): ``model.save`` / ``load_model`` bring it back
    with its codes, scales and maps, and training continues bit for bit.

    ``learning_rate``, ``beta_1``, ``beta_2``, ``epsilon``, ``weight_decay`` as Keras' ``AdamW`` (defaults:
    torchao's); other keyword arguments are Keras' optimizer base arguments.
    """

    def __init__(self, learning_rate: Any = 1e-3, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-8, weight_decay: float = 1e-2, name: str = "adamw8bit", **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        self.decay = float(weight_decay or 0.0)  # applied inside the step, torchao's order; not Keras' own

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._states: list[tuple[Any, ...]] = []
        for v in var_list:
            label = self._var_key(v).replace("/", "_")
            n = 1
            for d in v.shape:
                n *= int(d)
            if not quantizes(n):
                self._states.append(tuple(self.add_variable(shape=v.shape, dtype="float32", initializer="zeros",
                                                            name=f"{label}_{k}") for k in ("m", "v")))
                continue
            held = []
            for k, signed in (("m", True), ("v", False)):
                table = dynamic_map(signed)
                held += [self.add_variable(shape=v.shape, dtype="uint8", initializer="zeros",
                                           name=f"{label}_{k}_codes"),
                         self.add_variable(shape=(n // BLOCK_SIZE,), dtype="float32", initializer="zeros",
                                           name=f"{label}_{k}_scale"),
                         self.add_variable(shape=table.shape, dtype="float32", name=f"{label}_{k}_map",
                                           initializer=lambda shape, dtype=None, t=table: ops.convert_to_tensor(t))]
            self._states.append(tuple(held))

    @property
    def states(self) -> list[tuple[Any, ...]]:
        """:meth:`state_of` of every variable, in build order."""
        return list(self._states)

    def state_of(self, variable: Any) -> tuple[Any, ...]:
        """The variables holding ``variable``'s m and v: ``(m, v)`` plain, or
        ``(m_codes, m_scale, m_map, v_codes, v_scale, v_map)`` quantized."""
        return self._states[self._get_variable_index(variable)]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        q = KERAS_QUANT_OPS
        held = self.state_of(variable)
        step = ops.cast(self.iterations + 1, "float32")
        if len(held) == 2:
            m0, v0 = held
        else:
            m0, v0 = dequantize_8bit(*held[:3], q), dequantize_8bit(*held[3:], q)
        p, m, v = adam_step_8bit(variable, gradient, m0, v0, step, lr=ops.cast(learning_rate, "float32"),
                            beta1=self.beta_1, beta2=self.beta_2, eps=self.epsilon, weight_decay=self.decay,
                            decoupled=True, ops=q)
        if len(held) == 2:
            self.assign(held[0], m)
            self.assign(held[1], v)
        else:
            for (codes, scale, table), x in ((held[:3], m), (held[3:], v)):
                c, s = quantize_8bit(x, table, q)
                self.assign(codes, c)
                self.assign(scale, s)
        self.assign(variable, ops.cast(p, variable.dtype))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
                       "weight_decay": self.decay})
        return config


_BASE_KEYS = ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor", "gradient_accumulation_steps")


def eight_bit_inner(inner: keras.optimizers.Optimizer, plan: MasterPlan) -> keras.optimizers.Optimizer:
    """``inner`` unless ``plan`` quantizes states; then an :class:`AdamW8bit` with ``inner``'s hyperparameters
    (``inner`` a Keras ``Adam`` or ``AdamW`` without ``amsgrad`` or EMA, else ``ValueError``)."""
    if not plan.quantized_states or isinstance(inner, AdamW8bit):
        return inner
    if type(inner) not in (keras.optimizers.Adam, keras.optimizers.AdamW):
        raise ValueError(f"state_dtype='8bit' block-quantizes Adam's m and v: the inner optimizer must be "
                         f"keras.optimizers.Adam or AdamW (or keras_ext.weights.low_bit.AdamW8bit), not "
                         f"{type(inner).__name__}")
    config = inner.get_config()
    if config.get("amsgrad") or config.get("use_ema"):
        raise ValueError("state_dtype='8bit': amsgrad and use_ema are not offered")
    base = {k: config[k] for k in _BASE_KEYS if config.get(k) is not None}
    lr = inner._learning_rate
    lr = lr if callable(lr) else float(keras.ops.convert_to_numpy(lr))  # a schedule, or its current value
    return AdamW8bit(learning_rate=lr, beta_1=config["beta_1"], beta_2=config["beta_2"],
                     epsilon=config["epsilon"], weight_decay=config.get("weight_decay") or 0.0, **base)
