"""``bf16-master``'s AdamW/Adam step as one native pass per parameter (CPU, bf16 weights): the same bits.

The widened path (:mod:`lightning_ext.masters`) copies each bf16 gradient into an FP32 master gradient (2 B
read, 4 written per parameter), checks it, steps the masters with torch's fused kernel (16 read, 12 written)
and rounds the masters into the weights (4 read, 2 written). The one-pass step: the master's ``.grad`` *is*
the bf16 gradient (``grad_dtype=None`` lets an FP32 parameter hold one), the non-finite check is a read-only
scan of it (:func:`lightning_ext.grad_check.any_nonfinite`, 2 B read), and inside ``optimizer.step()`` the
call of torch's ``_fused_adamw_``/``_fused_adam_`` runs :data:`SOURCE` instead: one loop that reads the
gradient, master, ``exp_avg`` and ``exp_avg_sq`` and writes the last three and the bf16 weight (rounded to
nearest-even as ``_foreach_copy_``, NaN as 0xffff): 14 B read, 14 written. The FP32 parameters of that call
(the policy's FP32 modules) take the same loop with their FP32 gradients. The user's ``optimizer.step()``
still runs (hooks, state creation, step counts, LR schedulers are torch's; a step hook sees the masters'
gradients in bf16, the same values); what the pass cannot take (another thread's call, a stale bf16 gradient)
goes to torch's kernel, a bf16 gradient widened first.

The loop is torch 2.13's CPU kernel (``FusedAdamKernel.cpp``, FP32) operation for operation: its vector
body for whole vectors (``width`` floats: FMAs where it calls ``vec::fmadd`` and where GCC contracted,
``exp_avg_sq = fma(c2*g, g, v*b2)`` and Adam's L2 term ``fma(p, wd, g)``), then its scalar tail as GCC
built it (``tail_width``-float chunks vectorized alike, the rest with ``fma(v, b2, (c2*g)*g)``);
``-ffp-contract=off`` elsewhere.  Every finite, infinite or zero result has torch's bits (a NaN master
stays a NaN; its payload may differ, as between torch's vector and scalar loops).  On load the pass is
checked against torch's kernel (Adam and AdamW, weight decay on and off, both lerp branches, every tail
length, special values, bf16 ties) and the scan against ``isfinite``; a mismatch, no compiler or a failed
build: one warning, and the widened path.  The writes bypass torch: the weights' version counters are
bumped (torch's kernel bumps none of the masters' and states').

The rule: the step is one pass only when nothing reads or changes the master gradients before it and
the pass is torch's kernel: the caller allows it (:func:`lightning_ext.plugin.nothing_reads_grads`: the
Trainer's automatic optimization, no clipping, no ``on_before_optimizer_step`` override, no monitor, no
FP8; loss scaling off), no remainders, an exact ``Adam``/``AdamW`` whose every group runs fused
(``fused=True``, or left to torch with the fused step on) without ``amsgrad``/``maximize``/``capturable``/
``differentiable`` or tensor hyperparameters, every master stepped on the CPU with a contiguous bf16 weight
and gradient, :data:`NATIVE` on, at most :data:`MAX_THREADS` intra-op threads, torch's CPU kernels built
for AVX2 or AVX-512, the library loaded (:func:`alias_grads`).  Otherwise the gradients are widened.  The
weights are kept during a one-pass step (it writes them): 16 B/param held, as on the widened path.
"""

from __future__ import annotations

import contextlib
import ctypes
from array import array
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from mp_callbacks.native import BF16, CLONES, SCAN, build_library, loaded_once

from .thread_swap import ThreadSwap

__all__ = ["MAX_THREADS", "NATIVE", "SOURCE", "NativeAdam", "alias_grads", "native_adam",
           "one_pass_step"]

NATIVE = True
"""Step eligible masters with the native pass (False: widened gradients and torch's kernel; the same bits)."""

MAX_THREADS = 1
"""The native pass is used while ``torch.get_num_threads()`` is at most this (it runs on one thread)."""

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
""" + CLONES + SCAN + BF16 + r"""
typedef struct { float coeff, b2, c2, bcs, eps, nss, decay, wd; int small; } coefs;
/* f rounded to the nearest bf16, ties to even (torch's vectorized copy: NaN -> 0xffff) */
static inline uint16_t rne(float f) { uint16_t r = rne_bits(f); return f != f ? (uint16_t)0xffff : r; }
/* elements [lo, hi): l2 = Adam's L2 term, sv = the scalar tail's exp_avg_sq contraction, wide = an FP32
   gradient and no weight (an FP32 parameter), else a bf16 gradient and weight */
static inline __attribute__((always_inline)) void span(int64_t lo, int64_t hi, int l2, int sv, int wide,
        const coefs *c, float *restrict p, const void *restrict g, float *restrict m, float *restrict v,
        uint16_t *restrict w) {
    const float coeff = c->coeff, b2 = c->b2, c2 = c->c2, bcs = c->bcs, eps = c->eps, nss = c->nss;
    const float decay = c->decay, wd = c->wd;
    const int small = c->small;
    for (int64_t i = lo; i < hi; i++) {
        float gi = wide ? ((const float *)g)[i] : up(((const uint16_t *)g)[i]), pi = p[i], mi = m[i], vi = v[i];
        if (l2) gi = fmaf(pi, wd, gi); else pi = pi * decay;
        mi = fmaf(coeff, gi - mi, small ? mi : gi);
        vi = sv ? fmaf(vi, b2, (c2 * gi) * gi) : fmaf(c2 * gi, gi, vi * b2);
        float den = sqrtf(vi) / bcs + eps;
        pi = pi + (nss * mi) / den;
        p[i] = pi; m[i] = mi; v[i] = vi;
        if (!wide) w[i] = rne(pi);
    }
}
/* ptrs: count params, then count grads, exp_avgs, exp_avg_sqs, weights (NULL: FP32 gradient) and steps */
CLONES void adam_onepass(int64_t count, const int64_t *sizes, void *const *ptrs, double lr, double beta1,
                         double beta2, double weight_decay, double eps, int32_t adamw, int64_t width,
                         int64_t tail_width) {
    float *const *params = (float *const *)ptrs, *const *exp_avgs = (float *const *)(ptrs + 2 * count);
    float *const *exp_avg_sqs = (float *const *)(ptrs + 3 * count);
    const void *const *grads = (const void *const *)(ptrs + count);
    uint16_t *const *weights = (uint16_t *const *)(ptrs + 4 * count);
    const float *const *steps = (const float *const *)(ptrs + 5 * count);
    for (int64_t k = 0; k < count; k++) {
        double step = (double)*steps[k];
        double bias_correction1 = 1 - pow(beta1, step), bias_correction2 = 1 - pow(beta2, step);
        double step_size = lr / bias_correction1;
        coefs c;
        float c1 = (float)(1 - beta1);
        c.small = fabsf(c1) < 0.5f;
        c.coeff = c.small ? c1 : c1 - 1.0f;
        c.b2 = (float)beta2; c.c2 = (float)(1 - beta2); c.bcs = (float)sqrt(bias_correction2);
        c.eps = (float)eps; c.nss = (float)(-step_size);
        c.decay = (adamw && weight_decay != 0) ? (float)(1 - lr * weight_decay) : 1.0f;
        c.wd = (float)weight_decay;
        int l2 = !adamw && weight_decay != 0;
        int64_t n = sizes[k], body = n - n % width, mid = body + (n - body) / tail_width * tail_width;
        float *p = params[k], *m = exp_avgs[k], *v = exp_avg_sqs[k];
        const void *g = grads[k];
        uint16_t *w = weights[k];
#define SPANS(L2, WIDE) { span(0, mid, L2, 0, WIDE, &c, p, g, m, v, w); span(mid, n, L2, 1, WIDE, &c, p, g, m, v, w); }
        if (l2) { if (!w) SPANS(1, 1) else SPANS(1, 0) }
        else { if (!w) SPANS(0, 1) else SPANS(0, 0) }
    }
}
/* 1 when a value of the tensors is inf or NaN (wide: FP32, else bf16), read only */
int32_t any_nonfinite(int64_t count, const int64_t *sizes, const void *const *data, const int32_t *wide) {
    for (int64_t k = 0; k < count; k++)
        if (wide[k] ? scan_f32((const uint32_t *)data[k], sizes[k]) : scan_bf16((const uint16_t *)data[k], sizes[k]))
            return 1;
    return 0;
}
"""

_FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
          "-mprefer-vector-width=512", "-lm"]
_WIDTHS = {"AVX512": (16, 8), "AVX2": (8, 8)}  # torch's CPU capability -> (its vector width, its tail's) in floats
_loaded: list[NativeAdam | None] = []  # one entry once tried
_BF16, _F32 = torch.bfloat16, torch.float32


class NativeAdam:
    """The loaded library's pass over lists of contiguous CPU tensors (FP32 masters and states, bf16 gradients
    and weights, or FP32 gradients and no weight; float32 step counts), for the vector widths of torch's kernel."""

    def __init__(self, lib: ctypes.CDLL, widths: tuple[int, int]) -> None:
        ptr, i64, dbl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
        self._fn = lib.adam_onepass
        self._fn.argtypes = [i64, ptr, ptr, dbl, dbl, dbl, dbl, dbl, ctypes.c_int32, i64, i64]
        self._fn.restype = None
        self._scan = lib.any_nonfinite
        self._scan.argtypes, self._scan.restype = [i64, ptr, ptr, ptr], ctypes.c_int32
        self.widths = widths

    def scan(self, tensors: list[Tensor], wide: list[bool] | None = None) -> bool:
        """Whether a value of the contiguous CPU bf16/FP32 ``tensors`` is inf or NaN (``wide``: which are FP32,
        when the caller knows)."""
        sizes, ptrs = array("q", map(Tensor.numel, tensors)), array("q", map(Tensor.data_ptr, tensors))
        wide = array("i", [t.dtype is _F32 for t in tensors] if wide is None else wide)
        return bool(self._scan(len(tensors), sizes.buffer_info()[0], ptrs.buffer_info()[0], wide.buffer_info()[0]))

    def step(self, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
             weights: list[Tensor | None], steps: list[Tensor], *, lr: float, beta1: float, beta2: float,
             weight_decay: float, eps: float, adamw: bool) -> None:
        """``torch._fused_adamw_`` (``adamw``) or ``_fused_adam_`` on ``params`` with the widened ``grads``
        (the step counts already advanced), each result also rounded into its bf16 weight (None: an FP32
        gradient, no weight)."""
        ptr = Tensor.data_ptr
        ptrs = array("q", chain(map(ptr, params), map(ptr, grads), map(ptr, exp_avgs), map(ptr, exp_avg_sqs),
                                [0 if w is None else w.data_ptr() for w in weights], map(ptr, steps)))
        sizes = array("q", map(Tensor.numel, params))
        self._fn(len(params), sizes.buffer_info()[0], ptrs.buffer_info()[0], float(lr), float(beta1), float(beta2),
                 float(weight_decay), float(eps), int(adamw), *self.widths)


def native_adam() -> NativeAdam | None:
    """The native pass when :data:`NATIVE` is on, the intra-op threads at most :data:`MAX_THREADS`, torch's
    CPU kernel vectorized (AVX2/AVX-512) and the library built, loaded and checked (tried once per process;
    a failure warns once); else None."""
    if not NATIVE or torch.get_num_threads() > MAX_THREADS:
        return None
    return loaded_once(_loaded, _checked, "lightning_ext.master_native: the native pass is unavailable ({err}); "
                       "bf16-master widens the gradients and steps with torch's kernel, and the inf/NaN check of "
                       "unscaled recipes runs torch's fused kernel where lightning_ext.check_native does not "
                       "(the same bits and decisions, slower)")


def _checked() -> NativeAdam:
    """Built for torch's vector width, loaded and checked."""
    widths = _WIDTHS.get(torch.backends.cpu.get_cpu_capability())
    if widths is None:
        raise RuntimeError(f"torch's CPU kernels are built for {torch.backends.cpu.get_cpu_capability()}")
    native = NativeAdam(ctypes.CDLL(str(build_library(SOURCE, "master_native", _FLAGS))), widths)
    _self_check(native)
    return native


def _self_check(native: NativeAdam) -> None:
    """The pass against torch's kernels: Adam and AdamW, weight decay 0 and 0.1, beta1 0.9 and 0.3, steps 1 and
    7, every size 1..40 (each tail length) and 4099; training-like values and special ones (infinities, NaNs,
    subnormals, signed zeros), and with lr 0 masters half of which are bf16 ties (the weight's rounding)."""
    gen = torch.Generator().manual_seed(0)
    sizes = [*range(1, 41), 4099]
    for adamw, wd, beta1, step, lr in ((True, 0.1, 0.9, 1, 1e-3), (True, 0.0, 0.3, 7, 1e-3),
                                       (False, 0.1, 0.3, 7, 1e-3), (False, 0.0, 0.9, 1, 1e-3),
                                       (True, 0.0, 0.9, 3, 0.0)):
        tensors = [_sample(n, gen, ties=not lr) for n in sizes]
        kw = {"lr": lr, "beta1": beta1, "beta2": 0.999, "weight_decay": wd, "eps": 1e-8}
        want = [[t.clone() for t in ts[:4]] for ts in tensors]
        steps = [torch.tensor(float(step)) for _ in sizes]
        kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
        kernel([w[0] for w in want], [w[1].float() for w in want], [w[2] for w in want], [w[3] for w in want], [],
               steps, amsgrad=False, maximize=False, **kw)
        got = [[t.clone() for t in ts[:4]] for ts in tensors]
        weights = [torch.empty(n, dtype=_BF16) if n % 3 else None for n in sizes]  # None: FP32 gradients
        native.step([g[0] for g in got], [g[1] if w is not None else g[1].float() for g, w in zip(got, weights)],
                    [g[2] for g in got], [g[3] for g in got], weights, steps, adamw=adamw, **kw)
        for (wp, _, wm, wv), (gp, _, gm, gv), w in zip(want, got, weights):
            if not (_same(wp, gp) and _same(wm, gm) and _same(wv, gv) and (w is None or _same(w, wp.to(_BF16)))):
                raise RuntimeError(f"the pass differs from torch's kernel ({'AdamW' if adamw else 'Adam'}, "
                                   f"weight decay {wd}, {wp.numel()} elements)")
        for t in (x for ts in tensors for x in ts[:2]):  # the scan: FP32 masters, bf16 gradients
            if native.scan([t]) != bool((~t.isfinite()).any()) or native.scan([t[t.isfinite()].contiguous()]):
                raise RuntimeError(f"the scan differs from isfinite ({t.dtype}, {t.numel()} elements)")


def _sample(n: int, gen: torch.Generator, ties: bool = False) -> list[Tensor]:
    """Master, bf16 gradient, exp_avg, exp_avg_sq of ``n`` elements; every 7th of them a special value (``ties``:
    half the masters halfway between two bf16 values)."""
    p = torch.randn(n, generator=gen)
    if ties:
        p.view(torch.int32)[::2] = (p.view(torch.int32)[::2] & -65536) | 0x8000
    g = (torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 3, (n,), generator=gen)).to(_BF16)
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-42, 3.0e38])
    pick = torch.randint(0, len(special), (n,), generator=gen)
    for t in (p, g, m, v):
        every = torch.arange(n) % 7 == int(torch.randint(0, 7, (), generator=gen))
        t[every] = special[pick[every]].to(t.dtype)
    v.abs_()
    return [p, g, m, v]


def _same(a: Tensor, b: Tensor) -> bool:
    """The same bits, or both NaN."""
    bits = torch.int16 if a.dtype == _BF16 else torch.int32
    return bool(((a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())).all())


# --------------------------------------------------------------------------- the step
def alias_grads(optimizer: Any, entries: list[Any], fused_step: bool) -> tuple[dict[int, Tensor], list[Tensor]] | None:
    """When ``optimizer``'s next step can be one pass (the module docstring's rule, the caller's part aside):
    each master's ``.grad`` becomes its bf16 gradient (the weight's ``.grad`` is released) and the answer is
    ``{id(master): bf16 weight}`` for :func:`one_pass_step` and those masters; else None, nothing changed."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize") or group.get("capturable") or group.get("differentiable"):
            return None
        if not (group.get("fused") is True or (fused_step and group.get("fused", False) is None
                                               and group.get("foreach") is None)):
            return None
        if any(isinstance(group.get(k), Tensor) for k in ("lr", "betas", "weight_decay", "eps")) or any(
                isinstance(b, Tensor) for b in group.get("betas", ())):
            return None
        for p in group["params"]:  # every parameter stepped on the CPU
            if p.grad is not None and not (p.is_cpu and p.grad.is_cpu):
                return None
    stepped = []
    for _, low, master in entries:
        grad = low.grad
        if grad is None:
            continue
        if not (grad.dtype is _BF16 and low.dtype is _BF16 and master.dtype is _F32 and type(grad) is Tensor
                and grad.layout is torch.strided and grad.is_contiguous() and low.is_contiguous()
                and master.is_contiguous()):  # a gradient of another shape: the setter below raises
            return None
        stepped.append((low, master, grad))
    if native_adam() is None:  # asked last: nothing is built where the pass could not apply
        return None
    table, masters = {}, []
    for low, master, grad in stepped:
        if master.grad is not None:
            master.grad = None
        if master.grad_dtype is not None:
            master.grad_dtype = None  # an FP32 parameter holding a bf16 gradient
        master.grad = grad
        low.grad = None
        table[id(master)] = low
        masters.append(master)
    return table, masters


@contextlib.contextmanager
def one_pass_step(optimizer: Any, table: dict[int, Tensor]) -> Iterator[set[int]]:
    """Around ``optimizer.step()``: its groups fused (those left to torch, restored after), and torch's
    ``_fused_adamw_``/``_fused_adam_`` calls of this thread run the masters of ``table`` (from
    :func:`alias_grads`) in one native pass; yields the ids of the weights written (with their masters)."""
    groups = [g for g in optimizer.param_groups if g.get("fused", False) is None]
    for group in groups:
        group["fused"] = True
    written: set[int] = set()
    try:
        with _swap.active((table, written)):
            yield written
    finally:
        for group in groups:
            group["fused"] = None


def _fused_adamw(*args: Any, **kwargs: Any) -> None:
    _take_over(True, *args, **kwargs)


def _fused_adam(*args: Any, **kwargs: Any) -> None:
    _take_over(False, *args, **kwargs)


def _take_over(adamw: bool, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], state_steps: list[Tensor], *,
               amsgrad: bool, lr: Any, beta1: float, beta2: float, weight_decay: float, eps: float,
               maximize: bool, grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
    """The kernel call: the registered masters with a bf16 gradient in the native pass, the rest (bf16
    gradients widened) in torch's kernel."""
    kernel = _swap.original("_fused_adamw_" if adamw else "_fused_adam_")
    step = _swap.state()
    native = native_adam() if step is not None else None
    mine, rest = [], []
    if native is not None and not (amsgrad or maximize or grad_scale is not None or found_inf is not None
                                   or isinstance(lr, Tensor)):
        table, written = step
        weights: list[Tensor | None] = []
        for i, p in enumerate(params):  # the registered masters (bf16 gradients) and dense FP32 parameters
            g, low = grads[i], table.get(id(p))
            if (g.dtype is _BF16 if low is not None else (
                    g.dtype is _F32 and p.dtype is _F32 and type(g) is Tensor and g.layout is torch.strided
                    and g.is_cpu and p.is_contiguous() and g.is_contiguous())) and (
                    state_steps[i].dtype is _F32 and exp_avgs[i].is_contiguous() and exp_avg_sqs[i].is_contiguous()):
                mine.append(i)
                weights.append(low)
            else:
                rest.append(i)
    else:
        rest = list(range(len(params)))
    if mine:
        lists = (params, grads, exp_avgs, exp_avg_sqs, state_steps)
        pick, g, m, v, s = lists if not rest else [[t[i] for i in mine] for t in lists]
        native.step(pick, g, m, v, weights, s, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                    adamw=adamw)
        lows = [w for w in weights if w is not None]
        if lows:
            torch.autograd.graph.increment_version(lows)  # as the weight copy would (torch's kernel bumps none)
            written.update(map(id, lows))
    if rest:
        lists = [[t[i] for i in rest] if t else t for t in
                 (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)]
        lists[1] = [g.float() if g.dtype is _BF16 and p.dtype is not _BF16 else g for p, g in zip(lists[0], lists[1])]
        kernel(*lists, amsgrad=amsgrad, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
               maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)


_swap = ThreadSwap(torch, {"_fused_adamw_": _fused_adamw, "_fused_adam_": _fused_adam})
"""torch's fused kernels answered by :func:`_take_over` while a one-pass step runs (state: (table, written))."""
