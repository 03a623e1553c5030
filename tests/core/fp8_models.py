"""Step-by-step models of the anchors' FP8 scaling rules, written from their documentation and source.

Each model follows its anchor's own structure and names (its order of
operations, its float32 arithmetic, its treatment of zero / tiny / non-finite
amaxes), so a test compares :func:`mp_callbacks.fp8.scaling.next_fp8_state` with an
independent statement of each rule.  The models record whatever amax they are
given, as the anchors do: a non-finite amax poisons their history.  A step that
the training loop skips is modelled with ``apply=False`` on that row: the
anchor's update is not run (Keras under ``LossScaleOptimizer`` skips the whole
step, its float8 variables included).

Every model steps a batch of independent sequences at once (rows), in float32.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def _keep(apply, new, old):
    """``new`` on the rows that apply the step, ``old`` on the others."""
    if apply is None:
        return new
    apply = np.asarray(apply, bool)
    return np.where(apply.reshape(apply.shape + (1,) * (np.ndim(new) - apply.ndim)), new, old)


class TEDelayedScalingModel:
    """Transformer Engine ``recipe.DelayedScaling`` for one tensor per row.

    TE keeps, per tensor, ``amax_history`` (``[amax_history_len]``), ``scale``
    and ``scale_inv``, all float32, initialised to zeros / 1 / 1.  The fp8
    forward (or backward) kernel writes the tensor's amax into
    ``amax_history[0]``.  After the pass, ``amax_and_scale_update`` (the CUDA
    kernel of ``fused_amax_and_scale_update_after_reduction``) does, per tensor:

    * ``last_amax = amax_history[0]``; the rolled history is
      ``a[i] = amax_history[i + 1]`` for ``i < L - 1`` and ``a[L - 1] = last_amax``;
    * ``amax = fmaxf`` over ``a``, starting from 0 (``fmaxf`` ignores NaN);
      ``"most_recent"`` uses ``last_amax`` instead;
    * the new history is ``a`` with slot 0 set to 0;
    * ``scaled_max = fp8_max * 2**-margin``; ``scale = scaled_max / amax`` if
      ``isfinite(amax) && amax > 0`` else the old scale; an inf scale becomes
      ``FLT_MAX``; ``scale_inv = 1 / scale``.
    """

    def __init__(self, batch: int, fp8_max: float, history_len: int = 1024, algo: str = "max", margin: int = 0):
        self.amax_history = np.zeros((batch, history_len), f32)
        self.scale = np.ones(batch, f32)
        self.scale_inv = np.ones(batch, f32)
        self.scaled_max = f32(fp8_max) * f32(2.0) ** f32(-margin)
        self.algo = algo

    def forward(self, amax, apply=None) -> None:
        """The fp8 kernel of this step writes its tensor's amax into slot 0."""
        history = self.amax_history.copy()
        history[:, 0] = amax
        self.amax_history = _keep(apply, history, self.amax_history)

    def update(self, apply=None) -> None:
        """``amax_and_scale_update`` after the pass."""
        history = self.amax_history
        last_amax = history[:, 0]
        a = np.concatenate([history[:, 1:], last_amax[:, None]], axis=1)
        amax = np.fmax.reduce(np.concatenate([np.zeros_like(last_amax)[:, None], a], axis=1), axis=1)
        if self.algo == "most_recent":
            amax = last_amax.copy()
        updated = a.copy()
        updated[:, 0] = 0.0
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            scale = np.where(np.isfinite(amax) & (amax > 0), self.scaled_max / amax, self.scale).astype(f32)
            scale = np.where(np.isinf(scale), FLT_MAX, scale).astype(f32)
            scale_inv = (f32(1.0) / scale).astype(f32)
        self.amax_history = _keep(apply, updated, history)
        self.scale = _keep(apply, scale, self.scale)
        self.scale_inv = _keep(apply, scale_inv, self.scale_inv)

    def step(self, amax, apply=None) -> None:
        self.forward(np.asarray(amax, f32), apply)
        self.update(apply)


class KerasFloat8Model:
    """Keras 3 float8 training (``Dense.quantize("float8")``) for one tensor per row.

    The layer keeps a float32 ``scale`` (initialiser "ones") and an
    ``amax_history`` (``amax_history_length``, default 1024, "zeros") per
    tensor, both overwritten with their "gradients" by the optimizer.  In a
    training call, before this step's tensor is looked at:

    * ``new_scale = compute_float8_scale(max(amax_history), scale, fp8_max)``:
      ``sf = 1 / scale``; ``new = (fp8_max / amax) / 2**margin``;
      ``new = where(amax > 0, new, sf)``; ``new = where(isfinite(amax), new, sf)``;
      returns ``1 / new`` (the stored ``scale`` is the inverse: the tensor is
      quantized as ``x / scale`` and dequantized as ``q * scale``);
    * ``new_amax_history = compute_float8_amax_history(x, amax_history)``:
      ``roll(amax_history, -1)`` with slot 0 set to ``max(|x|)``.

    ``max`` over the history is ``tf.reduce_max``: NaN propagates (np.max).
    """

    def __init__(self, batch: int, fp8_max: float, history_len: int = 1024, margin: int = 0):
        self.scale = np.ones(batch, f32)
        self.amax_history = np.zeros((batch, history_len), f32)
        self.fp8_max = f32(fp8_max)
        self.margin = margin

    def compute_float8_scale(self, amax, scale):
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            sf_prev = (f32(1.0) / scale).astype(f32)
            sf = ((self.fp8_max / amax) / f32(2.0**self.margin)).astype(f32)
            sf = np.where(amax > 0.0, sf, sf_prev)
            sf = np.where(np.isfinite(amax), sf, sf_prev)
            return (f32(1.0) / sf).astype(f32)

    def compute_float8_amax_history(self, amax, amax_history):
        new = np.roll(amax_history, -1, axis=1)
        new[:, 0] = amax
        return new

    def step(self, amax, apply=None) -> None:
        new_scale = self.compute_float8_scale(np.max(self.amax_history, axis=1), self.scale)
        new_history = self.compute_float8_amax_history(np.asarray(amax, f32), self.amax_history)
        self.scale = _keep(apply, new_scale, self.scale)
        self.amax_history = _keep(apply, new_history, self.amax_history)


class TorchaoModel:
    """torchao ``Float8Linear`` dynamic ("tensorwise") scaling for one tensor per row.

    ``amax_to_scale``: ``amax`` is taken to float64,
    ``scale = finfo(float8).max / clamp(amax, min=EPS)`` with ``EPS = 1e-12``,
    then cast to float32.  No history, no state: each step's scale comes from
    its own amax (NaN gives NaN, inf gives 0).  The matmul gets the inverse as
    ``scale.reciprocal()`` (float32) for ``torch._scaled_mm``.
    """

    EPS = 1e-12

    def __init__(self, batch: int, fp8_max: float):
        self.scale = np.ones(batch, f32)
        self.scale_inv = np.ones(batch, f32)
        self.fp8_max = float(fp8_max)

    def step(self, amax, apply=None) -> None:
        amax64 = np.asarray(amax, f32).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = (self.fp8_max / np.maximum(amax64, self.EPS)).astype(f32)  # np.maximum keeps NaN, as clamp
            scale_inv = (f32(1.0) / scale).astype(f32)
        self.scale = _keep(apply, scale, self.scale)
        self.scale_inv = _keep(apply, scale_inv, self.scale_inv)
