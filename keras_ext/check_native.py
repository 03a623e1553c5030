"""The step's inf/NaN check as one TensorFlow op over the gradients (CPU; the twin of
:mod:`lightning_ext.check_native`).

Why: :func:`keras_ext.grad_check.found_inf` traces ``IsFinite`` + ``All`` per gradient and an ``All`` over them,
two graph ops per gradient; here the traced step holds one op, ``MpAnyNonfinite``, that reads every gradient
once (read only, last first) with :data:`~mp_callbacks.native.SCAN`, the loop of Lightning's check.

Rule: :func:`native_check` gives the op where it applies: Keras on the TensorFlow backend, no GPU visible (the
op has a CPU kernel only), :data:`NATIVE` on and the library built, loaded and checked; else None.  The caller
passes it dense float32/bfloat16 gradients only, and not while tracing for XLA (``jit_compile=True``: a custom
op does not compile there); anything else takes the generic check (the same decisions).

Build: a TensorFlow op library against TensorFlow's headers (``tf.sysconfig`` flags, ``$CXX`` else ``c++``),
built by the first call (~6 s, once per source, compiler and TensorFlow, into the cache folder of
:func:`~mp_callbacks.native.build_library`), then checked against ``tf.math.is_finite``.  No compiler, a failed
build or load, or a mismatch: one warning, and the generic check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mp_callbacks.native import CLONES, SCAN, build_library, loaded_once

from .ops import is_tf

__all__ = ["NATIVE", "SOURCE", "NativeCheck", "build_op_library", "load_cpu_op", "native_check"]

T = TypeVar("T")

NATIVE = True
"""Check with the op (False: the generic check; the same decisions)."""

SOURCE = r"""
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include <stdint.h>
""" + CLONES + SCAN + r"""
using namespace tensorflow;
REGISTER_OP("MpAnyNonfinite")
    .Input("values: T")
    .Attr("T: list({float, bfloat16}) >= 0")
    .Output("found: bool")
    .SetShapeFn([](shape_inference::InferenceContext *c) { c->set_output(0, c->Scalar()); return absl::OkStatus(); });
/* found: a value of the inputs is inf or NaN (read only, last input first) */
class MpAnyNonfiniteOp : public OpKernel {
  public:
    explicit MpAnyNonfiniteOp(OpKernelConstruction *c) : OpKernel(c) {}
    void Compute(OpKernelContext *c) override {
        int32_t found = 0;
        for (int i = c->num_inputs() - 1; i >= 0 && !found; --i) {
            const Tensor &t = c->input(i);
            const char *data = t.tensor_data().data();
            found = t.dtype() == DT_FLOAT ? scan_f32((const uint32_t *)data, t.NumElements())
                                          : scan_bf16((const uint16_t *)data, t.NumElements());
        }
        Tensor *out = nullptr;
        OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({}), &out));
        out->scalar<bool>()() = found != 0;
    }
};
REGISTER_KERNEL_BUILDER(Name("MpAnyNonfinite").Device(DEVICE_CPU), MpAnyNonfiniteOp);
"""


class NativeCheck:
    """The loaded op."""

    def __init__(self, library: Any) -> None:
        self._op = library.mp_any_nonfinite

    def found_inf(self, grads: list[Any]) -> Any:
        """A 0-d bool tensor: a value of the dense float32/bfloat16 ``grads`` is inf or NaN."""
        return self._op(list(grads))


def native_check() -> NativeCheck | None:
    """The op where it applies (the module's rule), built, loaded and checked on the first call (a failure
    warns once); else None."""
    if not NATIVE or not is_tf():
        return None
    return _loaded()


@functools.cache
def _loaded() -> NativeCheck | None:
    """The op, tried once per process (:func:`load_cpu_op`)."""
    return load_cpu_op(_build, NativeCheck, _self_check,
                       "keras_ext.check_native: the native inf/NaN check is unavailable ({err}); "
                       "the check runs as IsFinite + All per gradient (the same decisions, slower)")


def load_cpu_op(build: Callable[[], Path], wrap: Callable[[Any], T], check: Callable[[T], None],
                unavailable: str) -> T | None:
    """``wrap(tf.load_op_library(build()))`` once ``check`` passed on it, built and loaded eagerly (under
    ``tf.init_scope``: also when the first call comes while a step is being traced); None with a GPU visible
    (the ops have CPU kernels only), or after one warning (``unavailable``) when a step fails."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return None

    def load() -> T:
        with tf.init_scope():
            native = wrap(tf.load_op_library(str(build())))
            check(native)
        return native

    return loaded_once([], load, unavailable)


def _build() -> Any:
    """The op library's path, built into the cache folder unless already there."""
    return build_op_library(SOURCE, "keras_check_native")


def build_op_library(source: str, stem: str, flags: Sequence[str] = ()) -> Path:
    """The path of TensorFlow op library ``source`` (C++ against TensorFlow's headers, ``-O3`` and ``flags``),
    built by :func:`~mp_callbacks.native.build_library` unless already there (keyed by TensorFlow's version)."""
    import tensorflow as tf

    return build_library(source, stem, ["-O3", "-shared", "-fPIC", "-w", *flags,
                                        f"-DMP_TF_VERSION={tf.__version__.replace('+', '_')}",
                                        *tf.sysconfig.get_compile_flags()],
                         language="c++", link=tf.sysconfig.get_link_flags())


def _self_check(native: NativeCheck) -> None:
    """The op against ``tf.math.is_finite`` on float32 and bfloat16 tensors of every length 1..40 and 4099, one
    special value (inf, -inf, NaN; or the largest finite value, a subnormal, -0) at each of three places, a
    finite tensor beside it; and no tensors."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    specials = [np.inf, -np.inf, np.nan, 3.0e38, 1e-40, -0.0]
    for dtype in (tf.float32, tf.bfloat16):
        for n in (*range(1, 41), 4099):
            for where in {0, n // 2, n - 1}:
                for value in specials:
                    values = rng.standard_normal(n).astype(np.float32)
                    values[where] = value
                    t = tf.cast(tf.constant(values), dtype)
                    want = not bool(tf.reduce_all(tf.math.is_finite(t)))
                    if bool(native.found_inf([tf.ones([3], dtype), t])) != want:
                        raise RuntimeError(f"the op differs from is_finite ({dtype.name}, {n} elements)")
    if bool(native.found_inf([])):
        raise RuntimeError("the op found a non-finite value in no tensors")
