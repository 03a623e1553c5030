"""An Adam/AdamW update as one TensorFlow op (CPU): the twin of :mod:`lightning_ext.master_native`.

Why: on TensorFlow the step's update is Keras' own, traced per variable (a weight-decay read, multiply and
assign, Adam's dozen ops; under ``*-master`` also a widening cast and the write-back's cast and assign), or
under ``*-master`` that graph compiled by XLA (:func:`keras_ext.rounding_step.whole_step`); each op is a pass
over its tensors and a dispatch.  Here the update is one op, ``MpMasterAdam``, that steps every variable in
place in one pass: it reads the gradient (bf16 or FP32), the FP32 master and both moments, and writes the
master, the moments and, under ``*-master``, the bf16 variable.  A variable kept in FP32 is its own master
(every variable of ``32-true``, ``bf16-mixed``, ``16-mixed``).

The math is Keras': the base optimizer's decoupled weight decay (``p - p * wd * lr``) then
``keras.optimizers.Adam.update_step`` (``m + (g - m) * (1 - beta_1)``, ``v + (g * g - v) * (1 - beta_2)``,
``p - m * alpha / (sqrt(v) + epsilon)``), operation for operation in float32 with no contraction; ``alpha``
(the bias correction) is computed in the graph by Keras' own expression once per step; a bf16 gradient is
widened and divided by the scale as :func:`keras_ext.grad_check.unscale`; the bf16 variable is the master
rounded as TensorFlow's cast (nearest even; a NaN as 0x7fc0, as its vector loop writes every NaN).  So the bits
are those of Keras' update run op by op (checked on load against it run eagerly, :func:`_self_check`; the tests
compare whole runs against it traced); XLA's (the ``*-master`` fallback) may differ in the last bit where it
contracts ``a * b + c``.  The learning rate (a schedule too), weight decay and its exclusions, ``iterations``
and every other part of ``apply`` stay the inner optimizer's: only its ``_apply_weight_decay`` and
``_backend_update_step`` are replaced, for the duration of one traced call (:func:`fused_in_update`).  A
variable whose gradient is an ``IndexedSlices`` (an embedding's) keeps Keras' own decay and ``update_step``
(which mix sparse and dense arithmetic on it).

Rule (:func:`applies`): TensorFlow, no GPU visible (a CPU kernel only), :data:`NATIVE` on, the library built,
loaded and checked; an exact ``keras.optimizers.Adam``/``AdamW`` without ``amsgrad`` or EMA whose gradients
reach ``update_step`` untouched (:func:`keras_ext.masters.widens_in_update`: no clipping, accumulation or
``loss_scale_factor``) and whose moments are FP32, no ``tf.distribute`` strategy in scope, not inside an XLA
function; the caller's part
(:meth:`keras_ext.LossScaleOptimizer._native_update`): :class:`~keras_ext.masters.MasterWeights` (no update
rounding, no remainders), and under ``*-master`` the gradients widened in the update (no monitor, one replica).
Else Keras' update (the same decisions).  The kernel shards each variable over TensorFlow's intra-op threads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

from mp_callbacks.native import BF16, CLONES

from .check_native import build_op_library, load_cpu_op
from .ops import dtype_name, in_xla_context, is_tf

__all__ = ["NATIVE", "SOURCE", "NativeMasterAdam", "applies", "fused_in_update", "native_master_adam"]

NATIVE = True
"""Step eligible masters with the op (False: Keras' update, widened in it; the same bits as run op by op)."""

SOURCE = r"""
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"
#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <vector>
""" + CLONES + BF16 + r"""
/* TensorFlow's cast to bf16: nearest even, NaN 0x7fc0 (as its vector loop writes any NaN) */
static inline uint16_t tf_bf16(float f) { return f != f ? (uint16_t)0x7fc0u : rne_bits(f); }
typedef struct { float lr, alpha, wd, scale, c1, c2, eps; } coefs;
/* elements [lo, hi) of one variable: decay = the weight decay applies, divide = unscale, wide = an FP32 gradient
   (else bf16), w = the bf16 weight to round the master into (else none: a variable that is its own master) */
static inline __attribute__((always_inline)) void span(int64_t lo, int64_t hi, int decay, int divide, int wide,
        int weight, const coefs *c, const void *__restrict g, float *__restrict p, float *__restrict m,
        float *__restrict v, uint16_t *__restrict w) {
    const float lr = c->lr, alpha = c->alpha, wd = c->wd, scale = c->scale, c1 = c->c1, c2 = c->c2, eps = c->eps;
    for (int64_t i = lo; i < hi; i++) {
        float pi = p[i];
        if (decay) pi = pi - (pi * wd) * lr;
        float gi = wide ? ((const float *)g)[i] : up(((const uint16_t *)g)[i]);
        if (divide) gi = gi / scale;
        float mi = m[i] + (gi - m[i]) * c1;
        float vi = v[i] + (gi * gi - v[i]) * c2;
        pi = pi - (mi * alpha) / (sqrtf(vi) + eps);
        p[i] = pi; m[i] = mi; v[i] = vi;
        if (weight) w[i] = tf_bf16(pi);
    }
}
CLONES static void adam_span(int64_t lo, int64_t hi, int decay, int divide, int wide, const coefs *c,
                             const void *g, float *p, float *m, float *v, uint16_t *w) {
#define SPAN(D, S, G, W) span(lo, hi, D, S, G, W, c, g, p, m, v, w)
#define WEIGHT(D, S, G) { if (w) SPAN(D, S, G, 1); else SPAN(D, S, G, 0); }
#define WIDE(D, S) { if (wide) WEIGHT(D, S, 1) else WEIGHT(D, S, 0) }
    if (decay) { if (divide) WIDE(1, 1) else WIDE(1, 0) }
    else { if (divide) WIDE(0, 1) else WIDE(0, 0) }
#undef WIDE
#undef WEIGHT
#undef SPAN
}
using namespace tensorflow;
REGISTER_OP("MpMasterAdam")
    .Input("grads: T")
    .Input("masters: n * resource")
    .Input("momentums: n * resource")
    .Input("velocities: n * resource")
    .Input("weights: k * resource")
    .Input("lr: float")
    .Input("alpha: float")
    .Input("weight_decay: float")
    .Input("scale: float")
    .Attr("T: list({float, bfloat16}) >= 1")
    .Attr("n: int >= 1")
    .Attr("k: int >= 0")
    .Attr("weight_of: list(int)")
    .Attr("decays: list(bool)")
    .Attr("divides: list(bool)")
    .Attr("c1: float")
    .Attr("c2: float")
    .Attr("epsilon: float")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);
/* Adam/AdamW on n FP32 masters (with their moments) from n gradients (FP32 or bf16; divides[i]: divided by the
   scale); master i also rounded into bf16 weight weight_of[i] (-1: none); every variable written in place
   (copied first when its buffer is shared, as TensorFlow's training ops do) */
class MpMasterAdamOp : public OpKernel {
  public:
    explicit MpMasterAdamOp(OpKernelConstruction *c) : OpKernel(c) {
        OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
        OP_REQUIRES_OK(c, c->GetAttr("k", &k_));
        OP_REQUIRES_OK(c, c->GetAttr("weight_of", &weight_of_));
        OP_REQUIRES_OK(c, c->GetAttr("decays", &decays_));
        OP_REQUIRES_OK(c, c->GetAttr("divides", &divides_));
        OP_REQUIRES_OK(c, c->GetAttr("c1", &c1_));
        OP_REQUIRES_OK(c, c->GetAttr("c2", &c2_));
        OP_REQUIRES_OK(c, c->GetAttr("epsilon", &eps_));
        OP_REQUIRES(c, (int)weight_of_.size() == n_ && (int)decays_.size() == n_ && (int)divides_.size() == n_,
                    errors::InvalidArgument("weight_of, decays and divides need one entry per master"));
    }
    void Compute(OpKernelContext *c) override {
        OP_REQUIRES(c, c->num_inputs() == 4 * n_ + k_ + 4, errors::InvalidArgument("expected one gradient per master"));
        const int scalars = 4 * n_ + k_;
        coefs k;
        k.lr = c->input(scalars).scalar<float>()(); k.alpha = c->input(scalars + 1).scalar<float>()();
        k.wd = c->input(scalars + 2).scalar<float>()(); k.scale = c->input(scalars + 3).scalar<float>()();
        k.c1 = c1_; k.c2 = c2_; k.eps = eps_;
        auto *workers = c->device()->tensorflow_cpu_worker_threads()->workers;
        for (int i = 0; i < n_; ++i) {
            const Tensor &g = c->input(i);
            const int w = weight_of_[i];
            const int wide = g.dtype() == DT_FLOAT;
            OP_REQUIRES(c, wide || g.dtype() == DT_BFLOAT16,
                        errors::InvalidArgument("gradient ", i, ": not FP32/bf16"));
            OP_REQUIRES(c, w < k_, errors::InvalidArgument("weight_of[", i, "] = ", w, " with ", k_, " weights"));
            core::RefCountPtr<Var> vars[4];
            const int inputs[4] = {n_ + i, 2 * n_ + i, 3 * n_ + i, w < 0 ? -1 : 4 * n_ + w};
            std::vector<mutex *> locks;
            for (int j = 0; j < 4; ++j) {
                if (inputs[j] < 0) continue;
                OP_REQUIRES_OK(c, LookupResource(c, HandleFromInput(c, inputs[j]), &vars[j]));
                locks.push_back(vars[j]->mu());
            }
            std::sort(locks.begin(), locks.end());  // in increasing address, as TensorFlow's training ops lock
            locks.erase(std::unique(locks.begin(), locks.end()), locks.end());
            for (mutex *mu : locks) mu->lock();
            absl::Status status = absl::OkStatus();
            void *data[4] = {nullptr, nullptr, nullptr, nullptr};
            for (int j = 0; j < 4 && status.ok(); ++j) {
                if (!vars[j]) continue;
                Tensor *t = vars[j]->tensor();
                const DataType want = j < 3 ? DT_FLOAT : DT_BFLOAT16;
                if (t->dtype() != want || t->shape() != g.shape() || !t->IsInitialized()) {
                    status = errors::InvalidArgument("variable ", j, " of master ", i, ": ", t->DebugString(),
                                                     ", gradient ", g.shape().DebugString());
                } else if (vars[j]->copy_on_read_mode.load() || !t->RefCountIsOne()) {  // a read holds the buffer
                    Tensor copy;
                    status = c->allocate_temp(t->dtype(), t->shape(), &copy);
                    if (status.ok()) {
                        memcpy((void *)copy.tensor_data().data(), t->tensor_data().data(), t->TotalBytes());
                        *t = copy;
                    }
                }
                if (status.ok()) data[j] = (void *)t->tensor_data().data();
            }
            if (status.ok()) {
                const void *gd = g.tensor_data().data();
                float *p = (float *)data[0], *m = (float *)data[1], *v = (float *)data[2];
                uint16_t *wt = (uint16_t *)data[3];
                const int decay = decays_[i], divide = divides_[i];
                auto run = [&](int64_t lo, int64_t hi) { adam_span(lo, hi, decay, divide, wide, &k, gd, p, m, v, wt); };
                workers->ParallelFor(g.NumElements(), 24, run);
            }
            for (mutex *mu : locks) mu->unlock();
            OP_REQUIRES_OK(c, status);
        }
    }
  private:
    int n_, k_;
    std::vector<int> weight_of_;
    std::vector<bool> decays_, divides_;
    float c1_, c2_, eps_;
};
REGISTER_KERNEL_BUILDER(Name("MpMasterAdam").Device(DEVICE_CPU), MpMasterAdamOp);
"""


class NativeMasterAdam:
    """The loaded op: :meth:`step` traces (or runs) one ``MpMasterAdam`` for an inner optimizer's update."""

    def __init__(self, library: Any) -> None:
        self._op = library.mp_master_adam

    def step(self, optimizer: Any, grads: Sequence[Any], targets: Sequence[Any], weights: Sequence[Any | None],
             learning_rate: Any, scale: Any | None) -> Any:
        """``optimizer``'s (Keras Adam/AdamW) weight decay and update of ``targets`` (FP32 masters, or FP32
        variables that are their own) from the dense ``grads`` (bf16 or FP32), each divided by ``scale`` (None: not
        divided), each master also rounded into its bf16 variable in ``weights`` (None: none)."""
        import tensorflow as tf

        f32 = tf.float32
        lr = tf.cast(learning_rate, f32)
        local_step = tf.cast(optimizer.iterations + 1, f32)  # Adam.update_step's alpha, its own ops
        beta_1_power = tf.pow(tf.cast(optimizer.beta_1, f32), local_step)
        beta_2_power = tf.pow(tf.cast(optimizer.beta_2, f32), local_step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        decay = optimizer.weight_decay is not None
        index = optimizer._get_variable_index  # noqa: SLF001 - Keras' own slot lookup
        lows = [w for w in weights if w is not None]
        weight_of, k = [], 0
        for w in weights:
            weight_of.append(-1 if w is None else k)
            k += w is not None
        return self._op(
            grads=list(grads), masters=[_handle(t) for t in targets],
            momentums=[_handle(optimizer._momentums[index(t)]) for t in targets],  # noqa: SLF001
            velocities=[_handle(optimizer._velocities[index(t)]) for t in targets],  # noqa: SLF001
            weights=[_handle(w) for w in lows], lr=lr, alpha=alpha,
            weight_decay=tf.cast(optimizer.weight_decay if decay else 0.0, f32),
            scale=tf.constant(1.0, f32) if scale is None else tf.cast(scale, f32), weight_of=weight_of,
            decays=[decay and bool(optimizer._use_weight_decay(t)) for t in targets],  # noqa: SLF001
            divides=[scale is not None] * len(targets), c1=1 - optimizer.beta_1, c2=1 - optimizer.beta_2,
            epsilon=optimizer.epsilon)


def _handle(variable: Any) -> Any:
    """The resource handle of a Keras variable (its ``tf.Variable``) or of a ``tf.Variable``."""
    import keras

    return (variable.value if isinstance(variable, keras.Variable) else variable).handle


def native_master_adam() -> NativeMasterAdam | None:
    """The op when :data:`NATIVE` is on and it loads (TensorFlow, no GPU visible; built and checked on the first
    call, a failure warns once); else None."""
    if not NATIVE or not is_tf():
        return None
    return _loaded()


@functools.cache
def _loaded() -> NativeMasterAdam | None:
    return load_cpu_op(_build, NativeMasterAdam, _self_check,
                       "keras_ext.master_native: the one-op master step is unavailable ({err}); "
                       "the update runs as Keras' ops per variable (the same decisions and bits, slower)")


def _build() -> Any:
    return build_op_library(SOURCE, "keras_master_native", ["-ffp-contract=off", "-fno-fast-math", "-fno-math-errno"])


def applies(optimizer: Any, grads: Sequence[Any], targets: Sequence[Any], weights: Sequence[Any | None]) -> bool:
    """Whether :func:`fused_in_update` may take this update (the module's rule; the caller has checked the
    masters, the monitor and the replicas)."""
    import keras

    from .masters import widens_in_update

    if not (NATIVE and is_tf() and type(optimizer) in (keras.optimizers.Adam, keras.optimizers.AdamW)
            and not optimizer.amsgrad and not optimizer.use_ema and widens_in_update(optimizer)
            and not in_xla_context()):
        return False
    import tensorflow as tf

    if tf.distribute.has_strategy():  # Keras' update reduces and updates through the strategy
        return False
    index = optimizer._get_variable_index  # noqa: SLF001 - Keras' own slot lookup
    for g, t, w in zip(grads, targets, weights):
        if g is None or getattr(t, "overwrite_with_gradient", False):  # Keras assigns these itself (FP8 scales)
            continue
        slots = (optimizer._momentums[index(t)], optimizer._velocities[index(t)])  # noqa: SLF001
        if not (dtype_name(t) == "float32" and dtype_name(g) in ("float32", "bfloat16")
                and all(s is not None and dtype_name(s) == "float32" for s in slots)
                and (w is None or dtype_name(w) == "bfloat16")):
            return False
    return native_master_adam() is not None  # asked last: nothing is built where the op could not apply


@contextlib.contextmanager
def fused_in_update(optimizer: Any, native: NativeMasterAdam, weights: dict[int, Any], scale: Any | None,
                    sparse: set[int] = frozenset()) -> Iterator[set[int]]:
    """Within the block, ``optimizer.apply`` runs its weight decay and per-variable updates as one ``MpMasterAdam``
    (``native``'s :meth:`NativeMasterAdam.step`); ``weights``: ``{id(master): its bf16 variable}``; ``sparse``:
    the ids of the variables whose gradient is an ``IndexedSlices`` (Keras' update mixes sparse and dense
    arithmetic on it: they keep Keras' own decay and ``update_step``, their gradient widened and divided by
    ``scale`` first); yields the ids of the bf16 variables the op wrote (no write-back for them)."""
    from .grad_check import unscale

    written: set[int] = set()
    decay, update_step = optimizer._apply_weight_decay, optimizer.update_step  # noqa: SLF001

    def decay_sparse(variables: list[Any]) -> None:  # the op decays the others
        decay([v for v in variables if id(v) in sparse])

    def update_all(grads: list[Any], variables: list[Any], learning_rate: Any) -> None:
        op = [(g, v) for g, v in zip(grads, variables) if id(v) not in sparse]
        if op:
            lows = [weights.get(id(v)) for _, v in op]
            native.step(optimizer, [g for g, _ in op], [v for _, v in op], lows, learning_rate, scale)
            written.update(id(w) for w in lows if w is not None)
        for g, v in zip(grads, variables):
            if id(v) in sparse:
                update_step(unscale(g, scale), v, learning_rate)

    optimizer._apply_weight_decay = decay_sparse  # instance attributes: shadow the methods for this call
    optimizer._backend_update_step = update_all
    try:
        yield written
    finally:
        del optimizer._apply_weight_decay, optimizer._backend_update_step


def _self_check(native: NativeMasterAdam) -> None:
    """The op against Keras' own update run eagerly (the base optimizer's weight decay, then Adam), then
    ``tf.cast`` to bf16: AdamW (weight decay 0.004, one variable excluded; two steps, divided by a scale) and Adam
    (one step), FP32 and bf16 gradients, sizes around the vector widths (1-33, 4099), training-like values with
    special ones (inf, NaN, subnormals, -0, huge) and masters on bf16 ties: every master, moment and weight bit
    for bit (NaNs as NaN: :func:`_same`).  ~0.3 s, once per process."""
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    sizes = [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 4099]
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-42, 3.0e38], np.float32)

    def sample(n: int, scale: float, ties: bool = False) -> np.ndarray:
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        if ties:
            bits = x.view(np.uint32)
            bits[::2] = (bits[::2] & 0xFFFF0000) | 0x8000
        every = np.arange(n) % 7 == rng.integers(7)
        x[every] = specials[rng.integers(len(specials), size=int(every.sum()))]
        return x

    for kind, steps, divide in ((keras.optimizers.AdamW, 2, True), (keras.optimizers.Adam, 1, False)):
        masters = [sample(n, 1.0, ties=n % 2 == 0) for n in sizes]
        wide = [n % 3 == 0 for n in sizes]  # FP32 gradient, no weight
        grads = [[sample(n, 10.0 ** rng.integers(-8, 3)) for n in sizes] for _ in range(steps)]
        scale = 1024.0 if divide else None
        results = []
        for fused in (False, True):
            opt = kind(learning_rate=1e-3, weight_decay=0.004 if kind is keras.optimizers.AdamW else None)
            ts = [keras.Variable(m, dtype="float32", name=f"m{i}") for i, m in enumerate(masters)]
            lows = [None if w else keras.Variable(tf.cast(m, tf.bfloat16), dtype="bfloat16") for m, w in
                    zip(masters, wide)]
            opt.build(ts)
            opt.exclude_from_weight_decay(var_list=ts[:1])
            for step_grads in grads:
                gs = [tf.constant(g) if w else tf.cast(tf.constant(g), tf.bfloat16) for g, w in zip(step_grads, wide)]
                if fused:
                    with fused_in_update(opt, native, {id(t): w for t, w in zip(ts, lows) if w is not None}, scale):
                        opt.apply(gs, ts)
                else:
                    gs = [tf.cast(g, tf.float32) if scale is None else tf.cast(g, tf.float32) / scale for g in gs]
                    opt.apply(gs, ts)
                    for t, w in zip(ts, lows):
                        if w is not None:
                            w.assign(tf.cast(t.value, tf.bfloat16))
            slots = [(opt._momentums[opt._get_variable_index(t)], opt._velocities[opt._get_variable_index(t)])  # noqa: SLF001
                     for t in ts]
            results.append([[np.asarray(t.value), np.asarray(m.value), np.asarray(v.value),
                             None if w is None else np.asarray(tf.bitcast(w.value, tf.uint16))]
                            for t, (m, v), w in zip(ts, slots, lows)])
        for i, (want, got) in enumerate(zip(*results)):
            if not all(a is None or _same(a, b) for a, b in zip(want, got)):
                raise RuntimeError(f"the op differs from Keras' update ({kind.__name__}, {sizes[i]} elements)")


def _same(a: Any, b: Any) -> bool:
    """The same bits, or both NaN (FP32, or bf16 bits; a NaN's sign and payload differ between TensorFlow's
    vector and scalar loops)."""
    import numpy as np

    if a.dtype == np.float32:
        return bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())
    nan = (a & 0x7F80 == 0x7F80) & (a & 0x7F != 0)
    return bool(((a == b) | (nan & (b & 0x7F80 == 0x7F80) & (b & 0x7F != 0))).all())
