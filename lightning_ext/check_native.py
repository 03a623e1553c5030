"""The step's inf/NaN check over an optimizer's gradients as one native call (CPU): no Python per gradient.

Why: the check runs right after the backward, when the interpreter's own code and objects are out of the
CPU's caches.  Listed, validated and handed to :mod:`ctypes` gradient by gradient in Python
(:func:`lightning_ext.grad_check.any_nonfinite`), the check of a 28-parameter transformer took ~150-220 us
of an 11 ms step in place, its C scan ~55-70 of them; as this one call ~75-110 us (``benchmarks/README.md``).

Rule: :meth:`NativeCheck.groups` reads ``optimizer.param_groups`` itself and returns 1 when a gradient holds
an inf or NaN, 0 when none does (parameters without a gradient are passed over), and -1 where the scan does
not apply, for the caller to decide by the Python path: a gradient that is not a plain dense contiguous
bf16/FP32 CPU tensor with its own storage (a sparse, strided, float16, tensor-subclass or wrapper one), a
parameter that is not a tensor, groups that are not a list of dicts holding a ``"params"`` list.  It reads
what ``p.grad`` holds in C++ (a Python subclass overriding ``grad`` is not consulted), scans the gradients
last parameter first (:mod:`lightning_ext.grad_check`'s order) with :data:`~mp_callbacks.native.SCAN`,
the same loop as the one-pass step's scan and keras_ext's, and releases the GIL while it reads the values.

Build: a CPython extension module against torch's headers (``$CXX``, else ``c++``; the Python headers),
built by the first call (~12 s, once per source, compiler, torch and Python, into the cache folder of
:func:`~mp_callbacks.native.build_library`; later processes load it in milliseconds), then checked against
the values it was given.  No compiler or headers, a failed build or load, or a mismatch: one warning, and the
Python path.  Switch: :data:`NATIVE`.  The scan runs on one thread: with more intra-op threads it takes at
most :data:`SERIAL_VALUES` gradient values (more: -1, and torch's kernel, spread over its threads).
"""

from __future__ import annotations

import importlib.util
import math
import sysconfig
from pathlib import Path
from typing import Any

import torch

from mp_callbacks.native import CLONES, SCAN, build_library, loaded_once

__all__ = ["NATIVE", "SERIAL_VALUES", "SOURCE", "NativeCheck", "native_check"]

NATIVE = True
"""Check with the native call (False: the Python path; the same decisions)."""

SERIAL_VALUES = 1 << 22
"""With more than one intra-op thread the native call scans at most this many gradient values (4 Mi, 16 MiB of
FP32).  Measured on a 2-vCPU AMD EPYC (Zen 4), the gradients out of the caches (``python
benchmarks/bench_check.py --serial-vs-kernel --threads 2``): torch's check kernel with its flag's host read took
1.03-1.43x the serial scan from 0.5 M to 8 M values, 0.96x at 32 M values in 100 tensors; where more cores
share the kernel, larger gradient sets are left to it."""

SOURCE = r"""
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <stdint.h>
#include <typeinfo>
#include <vector>
""" + CLONES + SCAN + r"""
/* the gradient of the parameter o (undefined: none), or 0 when o is not a tensor */
static const at::Tensor *grad_of(PyObject *o) {
    if (!THPVariable_Check(o)) return nullptr;
    return &THPVariable_Unpack(o).unsafeGetTensorImpl()->grad();
}
/* a plain dense contiguous bf16/FP32 CPU tensor with its own storage */
static bool scannable(const at::Tensor &g) {
    const c10::TensorImpl *impl = g.unsafeGetTensorImpl();
    if (typeid(*impl) != typeid(c10::TensorImpl) || impl->is_python_dispatch() || !g.is_cpu()) return false;
    if (g.layout() != at::kStrided || !g.has_storage() || !g.is_contiguous()) return false;
    return g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16;
}
/* (groups, limit): groups a list of dicts with a "params" list -> 1 (inf/NaN), 0 (none), -1 (the scan does
   not apply, or more than limit values when limit >= 0) */
static PyObject *groups_nonfinite(PyObject *, PyObject *args) {
    PyObject *groups;
    long long limit;
    if (!PyArg_ParseTuple(args, "OL", &groups, &limit)) return nullptr;
    if (!PyList_Check(groups)) return PyLong_FromLong(-1);
    std::vector<at::Tensor> grads;
    int64_t values = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(groups); k++) {
        PyObject *group = PyList_GET_ITEM(groups, k);
        PyObject *params = PyDict_Check(group) ? PyDict_GetItemString(group, "params") : nullptr;
        if (params == nullptr || !PyList_Check(params)) return PyLong_FromLong(-1);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
            const at::Tensor *g = grad_of(PyList_GET_ITEM(params, i));
            if (g == nullptr) return PyLong_FromLong(-1);
            if (!g->defined()) continue;
            if (!scannable(*g)) return PyLong_FromLong(-1);
            grads.push_back(*g);  /* held: the values stay alive while the GIL is released */
            values += g->numel();
        }
    }
    if (limit >= 0 && values > limit) return PyLong_FromLong(-1);
    int32_t found = 0;
    Py_BEGIN_ALLOW_THREADS
    for (auto g = grads.rbegin(); g != grads.rend() && !found; ++g)
        found = g->scalar_type() == at::kFloat ? scan_f32((const uint32_t *)g->const_data_ptr(), g->numel())
                                               : scan_bf16((const uint16_t *)g->const_data_ptr(), g->numel());
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(found);
}
static PyMethodDef methods[] = {{"groups_nonfinite", groups_nonfinite, METH_VARARGS, nullptr},
                                {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mp_check_native", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_mp_check_native(void) { return PyModule_Create(&module); }
"""


class NativeCheck:
    """The loaded module's check (the module's rule)."""

    def __init__(self, module: Any) -> None:
        self._groups = module.groups_nonfinite

    def groups(self, groups: Any) -> int:
        """``groups(optimizer.param_groups)`` -> 1, 0 or -1 (the module's rule; at more than one intra-op thread
        -1 also for more than :data:`SERIAL_VALUES` values)."""
        return self._groups(groups, -1 if torch.get_num_threads() <= 1 else SERIAL_VALUES)


_loaded: list[NativeCheck | None] = []  # one entry once tried


def native_check() -> NativeCheck | None:
    """The native check when :data:`NATIVE` is on and the module built, loaded and checked (tried once per
    process, built by the first call; a failure warns once); else None."""
    if not NATIVE:
        return None
    return loaded_once(_loaded, _checked, "lightning_ext.check_native: the native inf/NaN check is unavailable "
                       "({err}); the check runs its Python path (the same decisions, slower)")


def _checked() -> NativeCheck:
    """Built, loaded and checked."""
    native = NativeCheck(_load(_build()))
    _self_check(native)
    return native


def _build() -> Path:
    """The module's path, built into the cache folder unless already there."""
    from torch.utils.cpp_extension import include_paths, library_paths

    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").is_file():
        raise RuntimeError(f"no Python headers ({python_include}/Python.h not found)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O3", "-shared", "-fPIC", "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-DMP_TORCH_VERSION={torch.__version__.replace('+', '_')}", f"-I{python_include}",
             *(f"-I{p}" for p in include_paths())]
    libs = library_paths()
    link = [*(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu", "-ltorch_python"]
    return build_library(SOURCE, "check_native", flags, language="c++", link=link)


def _load(path: Path) -> Any:
    """Import the built extension module from ``path``."""
    spec = importlib.util.spec_from_file_location("mp_check_native", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _self_check(native: NativeCheck) -> None:
    """The check against the values it was given on FP32 and bf16 gradients of every length 1..40 and 4099, one special
    value (inf, -inf, NaN; or the largest finite value, a subnormal, -0) at each place; and the -1 cases."""
    specials = [float("inf"), float("-inf"), float("nan"), 3.0e38, 1e-40, -0.0]
    for dtype in (torch.float32, torch.bfloat16):
        for n in (*range(1, 41), 4099):
            p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
            for where in {0, n // 2, n - 1}:
                for value in specials:
                    grad = torch.randn(n).to(dtype)
                    grad[where] = value
                    p.grad = grad
                    want = int(not math.isfinite(float(grad[where])))  # randn's values are finite
                    if native.groups([{"params": [torch.nn.Parameter(torch.zeros(1)), p]}]) != want:
                        raise RuntimeError(f"the check differs from isfinite ({dtype}, {n} elements)")
    for grad in (torch.zeros(4, 4).t(), torch.zeros(4, 4, dtype=torch.float16), torch.zeros(4, 4).to_sparse()):
        p = torch.nn.Parameter(torch.zeros(4, 4, dtype=grad.dtype))
        p.grad = grad
        if native.groups([{"params": [p]}]) != -1:
            raise RuntimeError(f"the check took a gradient it cannot scan ({grad.dtype}, {grad.layout})")
