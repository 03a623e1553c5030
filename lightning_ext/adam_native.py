"""torch's default CPU ``Adam``/``AdamW`` step (its single-tensor loop) as one native pass: the same bits.

On the CPU an ``Adam``/``AdamW`` left to torch's default (``foreach=None``, ``fused=None``) steps with
``torch.optim.adam._single_tensor_adam``: per parameter eight elementwise kernels (weight decay, ``lerp_``,
``mul_``, ``addcmul_``, ``sqrt``, ``/``, ``add_``, ``addcdiv_``), each a dispatch, a pass over memory and
for three of them a new tensor: 1.5-1.8 ms of a 0.5 M-parameter transformer's step (28 tensors), where
torch's fused kernel takes 0.4 ms with other bits.  Under ``32-true``, ``bf16-mixed`` and ``16-mixed``
(the parameters FP32) the plugin's ``optimizer.step()`` runs with that function answered by
:data:`SOURCE` for this thread: per chunk of :data:`CHUNK` values of a parameter, one loop for
``exp_avg_sq``, MKL's root of the chunk, one loop for ``exp_avg`` and the parameter, so that the gradient,
the parameter and both moments come from memory once and the last three go back once.  The user's step still
runs (hooks, state creation, LR schedulers, checkpoints are torch's).

The same bits: torch 2.13's kernels operation for operation, as measured against them on this kind of CPU
(``-ffp-contract=off``; each FMA named): AdamW's decay ``p * (float)(1 - lr*wd)``, Adam's L2 term
``fma(p, wd, g)`` (``add``'s ``vec::fmadd``), ``lerp_``'s ``fma(w, g - m, m)`` (``fma(w - 1, g - m, g)``
for ``w >= 0.5``), ``addcmul_`` as GCC contracted it, ``fma(c2*g, g, v*b2)``, the square root by MKL's
``vmsSqrt`` in torch's mode (torch's CPU ``sqrt`` calls it: not always the correctly rounded root), then
``/ bcs + eps`` and ``p + (-step_size*m) / den``; the scalars computed as torch computes them in Python
(double; the step count advanced as a float32 tensor) and cast to float as its kernels do.  The vector
bodies and scalar tails of those kernels agree, so every length takes one formula.  Checked on load
against torch's own function (Adam and AdamW, weight decay on and off, both ``lerp_`` branches, steps 1
and 7, every length 1..40 and 4099, special values); a mismatch, no compiler or a failed build: one
warning, and torch's loop.  Any finite, infinite or zero result has torch's bits; a NaN stays a NaN.

The rule (:func:`single_tensor_pass`): an exact ``Adam``/``AdamW`` not compiled, :data:`NATIVE` on, the
library loaded; then per call of torch's function without ``amsgrad``, ``maximize``, ``capturable``,
``differentiable``, complex values, tensor hyperparameters or a gradient scale, each parameter whose
parameter, gradient and moments are dense contiguous FP32 CPU tensors (exact :class:`torch.Tensor`) with a
float32 CPU step count takes the pass, the others torch's loop; with more than one intra-op thread only
those of at most :data:`SERIAL` values (torch runs their kernels on one thread too; the pass is serial, the
bits the same either way).  The pass bumps the version counters torch's in-place kernels bump.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from array import array
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
import torch.optim.adam as _adam
from torch import Tensor

from mp_callbacks.native import CLONES, build_library, loaded_once

from . import master_native
from .thread_swap import ThreadSwap

__all__ = ["CHUNK", "NATIVE", "SERIAL", "SOURCE", "NativeSingleAdam", "native_single_adam", "single_tensor_pass"]

NATIVE = True
"""Step eligible parameters with the native pass (False: torch's single-tensor loop; the same bits)."""

CHUNK = 1024
"""Values per chunk: the chunk's moments are square-rooted by one ``vmsSqrt`` call while in cache."""

SERIAL = 32768
"""With more than one intra-op thread the pass takes parameters of at most this many values: torch's grain
size (``at::internal::GRAIN_SIZE``), below which its elementwise kernels run on one thread; larger ones keep
torch's parallel loop."""

_VML_MODE = 0x2 | 0x140000 | 0x100  # VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: torch's (ATen/cpu/vml.h)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
""" + CLONES + rf"""
#define CHUNK {CHUNK}
#define VML_MODE {_VML_MODE}LL
""" + r"""
typedef void (*vsqrt_fn)(int n, const float *a, float *r, long long mode);
typedef struct { float decay, wd, w, b2, c2, bcs, eps, nss; int small; } coefs;
/* exp_avg_sq of [lo, hi) (l2: Adam's L2 term added to the gradient first) */
static inline __attribute__((always_inline)) void second(int64_t lo, int64_t hi, int l2, const coefs *c,
        const float *restrict p, const float *restrict g, float *restrict v) {
    const float b2 = c->b2, c2 = c->c2, wd = c->wd;
    for (int64_t i = lo; i < hi; i++) {
        float gi = l2 ? fmaf(p[i], wd, g[i]) : g[i];
        v[i] = fmaf(c2 * gi, gi, v[i] * b2);
    }
}
/* exp_avg and the parameter of [lo, hi), given the roots of exp_avg_sq (decay: AdamW's, first) */
static inline __attribute__((always_inline)) void first(int64_t lo, int64_t hi, int l2, int decay,
        const coefs *c, float *restrict p, const float *restrict g, float *restrict m, const float *restrict root) {
    const float w = c->w, d = c->decay, wd = c->wd, bcs = c->bcs, eps = c->eps, nss = c->nss;
    const int small = c->small;
    for (int64_t i = lo; i < hi; i++) {
        float pi = p[i], mi = m[i];
        float gi = l2 ? fmaf(pi, wd, g[i]) : g[i];
        if (decay) pi = pi * d;
        mi = small ? fmaf(w, gi - mi, mi) : fmaf(w - 1.0f, gi - mi, gi);
        m[i] = mi;
        p[i] = pi + (nss * mi) / (root[i - lo] / bcs + eps);
    }
}
/* ptrs: count params, then count grads, exp_avgs, exp_avg_sqs and (float32) steps, each advanced by one */
CLONES void adam_single(int64_t count, const int64_t *sizes, void *const *ptrs, double lr, double beta1,
                        double beta2, double weight_decay, double eps, int32_t decoupled, vsqrt_fn vsqrt) {
    float root[CHUNK];
    for (int64_t k = 0; k < count; k++) {
        float *p = (float *)ptrs[k], *m = (float *)ptrs[2 * count + k], *v = (float *)ptrs[3 * count + k];
        const float *g = (const float *)ptrs[count + k];
        float *step_t = (float *)ptrs[4 * count + k];
        *step_t = *step_t + 1.0f;
        double step = (double)*step_t;
        double bias_correction1 = 1 - pow(beta1, step), bias_correction2 = 1 - pow(beta2, step);
        double step_size = lr / bias_correction1;
        coefs c;
        c.decay = (float)(1 - lr * weight_decay); c.wd = (float)weight_decay;
        c.w = (float)(1 - beta1); c.small = fabsf(c.w) < 0.5f;
        c.b2 = (float)beta2; c.c2 = (float)(1 - beta2); c.bcs = (float)pow(bias_correction2, 0.5);
        c.eps = (float)eps; c.nss = (float)(-step_size);
        int l2 = weight_decay != 0 && !decoupled, decay = weight_decay != 0 && decoupled;
        int64_t n = sizes[k];
        for (int64_t lo = 0; lo < n; lo += CHUNK) {
            int64_t hi = n - lo < CHUNK ? n : lo + CHUNK;
            if (l2) second(lo, hi, 1, &c, p, g, v); else second(lo, hi, 0, &c, p, g, v);
            if (vsqrt) vsqrt((int)(hi - lo), v + lo, root, VML_MODE);
            else for (int64_t i = lo; i < hi; i++) root[i - lo] = sqrtf(v[i]);
            if (l2) first(lo, hi, 1, 0, &c, p, g, m, root);
            else if (decay) first(lo, hi, 0, 1, &c, p, g, m, root);
            else first(lo, hi, 0, 0, &c, p, g, m, root);
        }
    }
}
"""

_FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
          "-mprefer-vector-width=512", "-lm"]
_F32 = torch.float32
_loaded: list[NativeSingleAdam | None] = []  # one entry once tried


class NativeSingleAdam:
    """The loaded library's pass over lists of contiguous FP32 CPU tensors (float32 step counts)."""

    def __init__(self, lib: ctypes.CDLL, vsqrt: int | None) -> None:
        i64, dbl = ctypes.c_int64, ctypes.c_double
        self._fn = lib.adam_single
        self._fn.argtypes = [i64, ctypes.c_void_p, ctypes.c_void_p, dbl, dbl, dbl, dbl, dbl, ctypes.c_int32,
                             ctypes.c_void_p]
        self._fn.restype = None
        self._vsqrt = vsqrt

    def step(self, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
             steps: list[Tensor], *, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
             decoupled: bool) -> None:
        """``torch.optim.adam._single_tensor_adam`` on these lists (its plain case; the step counts advanced
        here), the version counters bumped as its in-place kernels bump them (``exp_avg_sq`` twice, an
        AdamW parameter with weight decay twice)."""
        ptr = Tensor.data_ptr
        ptrs = array("q", chain(map(ptr, params), map(ptr, grads), map(ptr, exp_avgs), map(ptr, exp_avg_sqs),
                                map(ptr, steps)))
        sizes = array("q", map(Tensor.numel, params))
        self._fn(len(params), sizes.buffer_info()[0], ptrs.buffer_info()[0], float(lr), float(beta1), float(beta2),
                 float(weight_decay), float(eps), int(decoupled), self._vsqrt)
        decayed = params if decoupled and weight_decay != 0 else []  # mul_ then addcdiv_
        torch.autograd.graph.increment_version([*params, *decayed, *exp_avgs, *exp_avg_sqs, *exp_avg_sqs, *steps])


def native_single_adam() -> NativeSingleAdam | None:
    """The native pass when :data:`NATIVE` is on and the library built, loaded and checked (tried once per
    process; a failure warns once); else None."""
    if not NATIVE:
        return None
    return loaded_once(_loaded, _checked, "lightning_ext.adam_native: the native Adam/AdamW pass is unavailable "
                       "({err}); torch's single-tensor loop steps (the same bits, slower)")


def _vsqrt_address() -> int | None:
    """The address of MKL's ``vmsSqrt`` in torch's library (what torch's CPU ``sqrt`` calls), or None."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return ctypes.cast(lib.vmsSqrt, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _checked() -> NativeSingleAdam:
    """Built, loaded and checked against torch's loop."""
    native = NativeSingleAdam(ctypes.CDLL(str(build_library(SOURCE, "adam_native", _FLAGS))), _vsqrt_address())
    _self_check(native)
    return native


def _self_check(native: NativeSingleAdam) -> None:
    """The pass against torch's ``_single_tensor_adam``: Adam and AdamW, weight decay 0 and 0.1, beta1 0.9 and
    0.3, steps 1 and 7, every length 1..40 (each tail) and 4099, training-like and special values."""
    gen = torch.Generator().manual_seed(0)
    sizes = [*range(1, 41), 4099]
    for decoupled, wd, beta1, step in ((True, 0.1, 0.9, 0), (True, 0.0, 0.3, 6), (False, 0.1, 0.3, 6),
                                       (False, 0.0, 0.9, 0)):
        tensors = [master_native._sample(n, gen) for n in sizes]
        for ts in tensors:  # FP32 gradients of every magnitude, specials kept
            ts[1] = torch.where(ts[1].isfinite(), torch.randn(ts[1].shape, generator=gen), ts[1].float()) * ts[1].abs()
        kw = {"lr": 1e-3, "beta1": beta1, "beta2": 0.999, "weight_decay": wd, "eps": 1e-8}
        want = [[t.clone() for t in ts] for ts in tensors]
        want_steps = [torch.tensor(float(step)) for _ in sizes]
        _single_tensor_adam([w[0] for w in want], [w[1] for w in want], [w[2] for w in want], [w[3] for w in want],
                            [], want_steps, None, None, amsgrad=False, has_complex=False, maximize=False,
                            capturable=False, differentiable=False, decoupled_weight_decay=decoupled, **kw)
        got = [[t.clone() for t in ts] for ts in tensors]
        steps = [torch.tensor(float(step)) for _ in sizes]
        native.step([g[0] for g in got], [g[1] for g in got], [g[2] for g in got], [g[3] for g in got], steps,
                    decoupled=decoupled, **kw)
        for (wp, _, wm, wv), (gp, _, gm, gv), ws, s in zip(want, got, want_steps, steps):
            if not (master_native._same(wp, gp) and master_native._same(wm, gm) and master_native._same(wv, gv)
                    and float(ws) == float(s)):
                raise RuntimeError(f"the pass differs from torch's loop ({'AdamW' if decoupled else 'Adam'}, "
                                   f"weight decay {wd}, {wp.numel()} elements)")


# --------------------------------------------------------------------------- the step
_single_tensor_adam = _adam._single_tensor_adam  # torch's, as imported


@contextlib.contextmanager
def single_tensor_pass(optimizer: Any) -> Iterator[bool]:
    """Around ``optimizer.step()``: torch's single-tensor Adam/AdamW calls of this thread run the native
    pass where it applies (the module docstring's rule); yields whether it may."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or torch.compiler.is_compiling() or (
            native_single_adam() is None):
        yield False
        return
    with _swap.active(True):
        yield True


def _take_over(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               max_exp_avg_sqs: list[Tensor], state_steps: list[Tensor], grad_scale: Tensor | None,
               found_inf: Tensor | None, *, amsgrad: bool, has_complex: bool, beta1: Any, beta2: Any, lr: Any,
               weight_decay: Any, eps: float, maximize: bool, capturable: bool, differentiable: bool,
               decoupled_weight_decay: bool) -> None:
    """torch's function: the parameters the pass takes in one native call, the rest by torch's loop."""
    original = _swap.original("_single_tensor_adam")
    kw = {"amsgrad": amsgrad, "has_complex": has_complex, "beta1": beta1, "beta2": beta2, "lr": lr,
          "weight_decay": weight_decay, "eps": eps, "maximize": maximize, "capturable": capturable,
          "differentiable": differentiable, "decoupled_weight_decay": decoupled_weight_decay}
    native = native_single_adam() if _swap.state() and not torch.compiler.is_compiling() else None
    if native is None or amsgrad or has_complex or maximize or capturable or differentiable or (
            grad_scale is not None or found_inf is not None) or not all(
            type(x) in (float, int) for x in (beta1, beta2, lr, weight_decay, eps)):
        return original(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale, found_inf,
                        **kw)
    mine, rest = [], []
    serial = torch.get_num_threads() > 1
    for i, p in enumerate(params):
        g, m, v, s = grads[i], exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        if (type(p) is Tensor or type(p) is torch.nn.Parameter) and type(g) is Tensor and type(m) is Tensor and (
                type(v) is Tensor) and p.dtype is _F32 and g.dtype is _F32 and m.dtype is _F32 and v.dtype is _F32 and (
                p.is_cpu and g.is_cpu and m.is_cpu and v.is_cpu and g.layout is torch.strided) and (
                p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()) and (
                type(s) is Tensor and s.dtype is _F32 and s.is_cpu and s.numel() == 1) and (
                p.numel() == g.numel() == m.numel() == v.numel()) and not (serial and p.numel() > SERIAL):
            mine.append(i)
        else:
            rest.append(i)
    if mine:
        lists = (params, grads, exp_avgs, exp_avg_sqs, state_steps)
        picked = lists if not rest else [[t[i] for i in mine] for t in lists]
        native.step(*picked, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                    decoupled=decoupled_weight_decay)
    if rest:
        lists = [[t[i] for i in rest] if t else t for t in
                 (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)]
        original(*lists, grad_scale, found_inf, **kw)


_swap = ThreadSwap(_adam, {"_single_tensor_adam": _take_over})
"""torch's single-tensor loop answered by :func:`_take_over` while a step runs with the pass (state: True)."""
