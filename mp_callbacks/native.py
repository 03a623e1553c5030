"""Native code the adapters build at run time: the build, and the C sources they share.

Rule: :func:`build_library` compiles a source once per (source, compiler, machine, flags) into
``$XDG_CACHE_HOME/mp_callbacks`` (else ``~/.cache/mp_callbacks``; a private temporary folder if that is not
writable), as ``<stem>-<hash>.so``, written atomically (a concurrent process finds a whole file or none), and
returns its path; the callers load it (:mod:`ctypes`, an extension module, a TensorFlow op library), check it
against their framework's own result and fall back to their framework's path on any failure.  The sources
here (:data:`CLONES`, :data:`SCAN`) are C that compiles as C++ too, so each adapter's library holds the same
loop.  No framework is imported.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["BF16", "CLONES", "SCAN", "build_library", "loaded_once"]

T = TypeVar("T")

_BUILD_SECONDS = 180

CLONES = r"""
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
"""
"""C/C++: ``CLONES`` builds a function for AVX-512, AVX2 and baseline x86-64 (picked when loaded)."""

SCAN = r"""
/* 1 when one of the n values is inf or NaN (all exponent bits set), read only: FP32 ones as bits, bf16 ones */
CLONES static int32_t scan_f32(const uint32_t *x, int64_t n) {
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) { uint32_t e = x[i] & 0x7f800000u; top = e > top ? e : top; }
    return top == 0x7f800000u;
}
CLONES static int32_t scan_bf16(const uint16_t *x, int64_t n) {
    uint16_t top = 0;
    for (int64_t i = 0; i < n; i++) { uint16_t e = x[i] & 0x7f80u; top = e > top ? e : top; }
    return top == 0x7f80u;
}
"""
"""C/C++ (after :data:`CLONES`): the read-only inf/NaN scan of one FP32 or bf16 array: the step's non-finite
check of both adapters where they run it natively."""

BF16 = r"""
/* bf16 bits <-> float (needs <stdint.h>, <string.h>) */
static inline float up(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
/* f (not NaN) rounded to the nearest bf16, ties to even; NaN is the caller's (each framework writes its own) */
static inline uint16_t rne_bits(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    return (uint16_t)((b + (((b >> 16) & 1u) + 0x7fffu)) >> 16);
}
"""
"""C/C++: widening a bf16 value and rounding an FP32 one to bf16 (nearest, ties to even), as both frameworks'
casts do; the fused master steps of both adapters write their bf16 weights with it."""


def build_library(source: str, stem: str, flags: list[str], language: str = "c", link: list[str] | None = None
                  ) -> Path:
    """The shared library of ``source`` (``language`` "c": built with ``$CC``, else ``cc``; "c++": ``$CXX``,
    else ``c++``) built with ``flags`` (``link``: after the source): ``<stem>-<hash>.so`` in the cache folder
    (a private temporary one if that is not writable), built unless already there."""
    link = link or []
    cc = (os.environ.get("CC") or "cc") if language == "c" else (os.environ.get("CXX") or "c++")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no {language.upper()} compiler ({cc!r} not found)")
    digest = hashlib.sha256("\0".join([source, cc, platform.machine(), *flags, *link]).encode()).hexdigest()[:16]
    name = f"{stem}-{digest}.so"
    for folder in (_cache_folder(), None):
        if folder is not None and (folder / name).is_file():
            return folder / name
        try:
            if folder is None:  # removed at exit (a loaded library may be unlinked)
                folder = Path(tempfile.mkdtemp(prefix="mp_callbacks-"))
                atexit.register(shutil.rmtree, folder, True)
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src, out = Path(tmp) / f"{stem}.{'c' if language == 'c' else 'cpp'}", Path(tmp) / name
                src.write_text(source)
                done = subprocess.run([cc, *flags, str(src), "-o", str(out), *link], capture_output=True, text=True,
                                      timeout=_BUILD_SECONDS)
                if done.returncode != 0:
                    raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
                os.replace(out, folder / name)  # atomic: a concurrent process finds a whole file or none
            return folder / name
        except OSError:
            continue  # the cache folder is not writable: a private temporary one
    raise RuntimeError("no writable folder for the build")


def _cache_folder() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mp_callbacks"


def loaded_once(slot: list[T | None], load: Callable[[], T], unavailable: str) -> T | None:
    """``load()``'s result, tried once per process and kept in ``slot`` (an empty list the caller owns): a
    failure warns once, ``unavailable`` with ``{err}`` filled in (what runs instead), and keeps None."""
    if not slot:
        try:
            value: T | None = load()
        except Exception as err:  # noqa: BLE001 - any failure means the caller's framework path
            warnings.warn(unavailable.format(err=err), RuntimeWarning, stacklevel=3)
            value = None
        slot.append(value)
    return slot[0]
