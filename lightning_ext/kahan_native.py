"""The Kahan write-back of ``bf16-kahan``'s batched step as one native pass per segment (CPU, bf16): the same bits.

:mod:`lightning_ext.rounding_batch` builds each segment's FP32 value ``t = f32(w) + f32(c)`` (and the FP32
gradient) before torch's fused kernel and writes ``t`` back after it (``u = t - (f32(w) + f32(c))``,
``y = bf16(u) + c``, ``new = w + y``, ``c' = y - (new - w)``, ``w = new``, each bf16 operation rounded to
nearest-even) in about a dozen eager passes, each bf16 one an FP32 operation between two conversions.
Here each half is one loop of C (:data:`SOURCE`): FP32 arithmetic and the bf16 rounding of torch's CPU
kernels (c10's round-to-nearest-even on the FP32 bits), so every finite, infinite or zero result has the
eager passes' bits (a NaN stays a NaN; its payload bits may differ, as they do between torch's vectorized
and scalar loops).  ``-ffp-contract=off`` and no fast-math flags keep each operation IEEE; on x86-64 Linux
the loops are built for AVX2 and baseline x86-64, picked when loaded.

The library is built once with the C compiler (``$CC``, else ``cc``: ~0.2 s) into
``$XDG_CACHE_HOME/mp_callbacks`` (else ``~/.cache/mp_callbacks``; a private temporary folder if that is
not writable), named by a hash of the source and flags, and loaded with :mod:`ctypes` (a call costs ~2 us);
when loaded, it is checked bit for bit against the eager passes on special and random bit patterns.  No
compiler, a failed build or load, or a mismatch: one warning, and the eager passes are used (the same bits,
slower).  Switch: :data:`NATIVE` (False: the eager passes).  The loops run on one thread: with more
intra-op threads than :data:`MAX_THREADS` the eager passes (which torch spreads over its threads) are used.
The writes bypass torch, so the step bumps the written tensors' version counters itself.

torch.compile was measured first (Inductor on CPU with ``emulate_precision_casts``): bit-exact, but slower
than the eager passes on an AVX2 CPU (benchmarks/README.md), so it is not used.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from mp_callbacks.native import build_library, loaded_once

from .rounding_step import _kahan_chunk

__all__ = ["MAX_THREADS", "NATIVE", "SOURCE", "NativeKahan", "native_kahan"]

NATIVE = True
"""Write Kahan segments back with the native pass (False: the eager torch passes; the same bits)."""

MAX_THREADS = 1
"""The native pass is used while ``torch.get_num_threads()`` is at most this (it runs on one thread)."""

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif
static inline float up(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
/* f rounded to the nearest bf16, ties to even, kept in FP32 (c10's rule; NaN -> 0x7fc0) */
static inline float rnd(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    b = f != f ? 0x7fc00000u : (b + (((b >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;
    memcpy(&f, &b, 4); return f;
}
static inline uint16_t hi(float f) { uint32_t b; memcpy(&b, &f, 4); return (uint16_t)(b >> 16); }
/* t = f32(w) + f32(c); g32 = f32(g) when g is given */
CLONES void kahan_value(const uint16_t *restrict w, const uint16_t *restrict c, const uint16_t *restrict g,
                        float *restrict t, float *restrict g32, int64_t n) {
    for (int64_t i = 0; i < n; i++) t[i] = up(w[i]) + up(c[i]);
    if (g) for (int64_t i = 0; i < n; i++) g32[i] = up(g[i]);
}
/* u = t - (f32(w) + f32(c)); y = low(u) + c; new = w + y; c = y - (new - w); w = new (bf16 operations) */
CLONES void kahan_write(const float *restrict t, uint16_t *restrict w, uint16_t *restrict c, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float wf = up(w[i]), cf = up(c[i]);
        float y = rnd(rnd(t[i] - (wf + cf)) + cf);
        float nw = rnd(wf + y);
        c[i] = hi(rnd(y - rnd(nw - wf)));
        w[i] = hi(nw);
    }
}
"""

_FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]
_loaded: list[NativeKahan | None] = []  # one entry once tried


class NativeKahan:
    """The loaded library's two passes over contiguous CPU tensors (``w``, ``c``, ``g`` bf16; ``t``, ``g32``
    FP32; ``n`` elements each)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, n = ctypes.c_void_p, ctypes.c_int64
        self._value, self._write = lib.kahan_value, lib.kahan_write
        self._value.argtypes, self._value.restype = [ptr, ptr, ptr, ptr, ptr, n], None
        self._write.argtypes, self._write.restype = [ptr, ptr, ptr, n], None

    def value(self, w: Tensor, c: Tensor, t: Tensor, g: Tensor | None = None, g32: Tensor | None = None) -> None:
        """``t = f32(w) + f32(c)``; ``g32 = f32(g)`` when ``g`` is given."""
        self._value(w.data_ptr(), c.data_ptr(), None if g is None else g.data_ptr(),
                    t.data_ptr(), None if g32 is None else g32.data_ptr(), t.numel())

    def write(self, t: Tensor, w: Tensor, c: Tensor) -> None:
        """The Kahan write-back of the kernel's result ``t`` into ``w``, ``c`` (module docstring)."""
        self._write(t.data_ptr(), w.data_ptr(), c.data_ptr(), t.numel())


def native_kahan() -> NativeKahan | None:
    """The native passes when :data:`NATIVE` is on, the intra-op threads at most :data:`MAX_THREADS` and the
    library built, loaded and checked (tried once per process; a failure warns once); else None."""
    if not NATIVE or torch.get_num_threads() > MAX_THREADS:
        return None
    return loaded_once(_loaded, _checked, "lightning_ext.kahan_native: the native Kahan write-back is "
                       "unavailable ({err}); bf16-kahan uses the eager passes (the same bits, slower)")


def _checked() -> NativeKahan:
    """Built, loaded and checked."""
    native = NativeKahan(ctypes.CDLL(str(_build())))
    _self_check(native)
    return native


def _build() -> Path:
    """The library's path, built into the cache folder unless already there."""
    return build_library(SOURCE, "kahan_native", _FLAGS)


def _self_check(native: NativeKahan) -> None:
    """Both passes against the eager ones on 4099 elements (a vector tail): random bit patterns (infinities,
    NaNs, subnormals, signed zeros) and training-like values (small updates, where the roundings tie)."""
    gen = torch.Generator().manual_seed(0)
    n, half = 4099, 2048
    w = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int32, generator=gen).to(torch.int16).view(torch.bfloat16)
    c = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int32, generator=gen).to(torch.int16).view(torch.bfloat16)
    u = torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int64, generator=gen).to(torch.int32).view(torch.float32)
    w[:half] = torch.randn(half, generator=gen).bfloat16()
    c[:half] = (w[:half].float() * torch.randn(half, generator=gen) * 2.0**-9).bfloat16()
    scale = 2.0 ** torch.randint(-30, 0, (half,), generator=gen)
    u[:half] = w[:half].float() * torch.randn(half, generator=gen) * scale
    t, g32 = torch.empty(n), torch.empty(n)
    native.value(w, c, t, g=c, g32=g32)
    want = w.float() + c.float()
    if not (_same(t, want) and _same(g32, c.float())):
        raise RuntimeError("the value pass differs from the eager passes")
    t_new = want + u
    wn, cn, we, ce = w.clone(), c.clone(), w.clone(), c.clone()
    native.write(t_new.clone(), wn, cn)
    scratch = _Scratch(want)
    _kahan_chunk(we, ce, t_new.clone(), scratch)
    if not (_same(wn, we) and _same(cn, ce)):
        raise RuntimeError("the write-back differs from the eager passes")


class _Scratch:
    """:func:`~lightning_ext.rounding_step._kahan_chunk`'s buffers: ``t0`` given, the others new."""

    def __init__(self, t0: Tensor) -> None:
        self.t0 = t0

    def get(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.t0 if name == "t0" else torch.empty(n, dtype=dtype, device=device)


def _same(a: Tensor, b: Tensor) -> bool:
    """The same bits, or both NaN."""
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return bool(((a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())).all())
