"""Apply a :class:`~mp_callbacks.policy.PrecisionPolicy` to a ``torch.nn.Module`` tree.

The policy decides (:meth:`PrecisionPolicy.resolve`); this module only
translates the decision into torch mechanics:

* **FP32 modules** (norms, softmax, losses, embeddings, unknown custom leaves,
  and anything an explicit module rule maps to ``float32``) run with autocast
  disabled and their floating inputs cast to float32: their ``forward`` is
  wrapped in a ``torch.autocast(enabled=False)`` block, which ``torch.compile``
  traces (a hook pair that enters and leaves autocast cannot be compiled).
* **Parameter storage** (``*-master`` recipes): the parameters and floating
  buffers a module owns directly are cast to the low-precision dtype unless the
  policy keeps that module in FP32.  The cast keeps the ``Parameter`` objects
  (``param.data`` is replaced), so references held elsewhere stay valid.

Which modules get the FP32 *compute* hook: a module an explicit rule maps to
float32, or a *leaf* module (no children) that :meth:`PrecisionPolicy.keeps_fp32`.
Containers and the root are not hooked by class (their children decide),
otherwise an unknown root ``LightningModule`` would switch the whole model to
FP32; an explicit module rule can still name them.  Parameters owned directly
by a module of an unknown class (a raw ``nn.Parameter`` on a custom module)
stay FP32 under ``*-master``: declare such modules with a module rule
(``{"MyBlock": "bfloat16"}``) to store them in low precision.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mp_callbacks.policy import PrecisionPolicy, class_names

__all__ = ["ModulePolicyHandle", "apply_module_policy", "buffers_to_fp32", "cast_module_storage",
           "fp32_compute_modules", "policy_report", "restore_module_storage", "torch_dtype"]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    return _TORCH_DTYPES[name]


# torch.nn classes whose own forward runs none of autocast's low-precision ops (matmul, linear, conv,
# attention) on any device: autocast's fp32 list or no list, so with FP32 inputs autocast on or off
# computes the same.  As FP32 regions they need their inputs cast, not autocast left and re-entered.
_AUTOCAST_NEUTRAL: frozenset[type] = frozenset({
    nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
    nn.Embedding, nn.Softmax, nn.LogSoftmax})


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype != torch.float32 and value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to_fp32(v)) for k, v in value.items())
    return value


_F32 = torch.float32


def _fp32_args(args: tuple) -> tuple:
    """``args`` with floating tensors cast to FP32: the same tuple when every item is a plain tensor that needs no
    cast (an FP32 activation, integer ids: the common call, checked without rebuilding anything)."""
    for a in args:
        if type(a) is not torch.Tensor or (a.dtype is not _F32 and a.is_floating_point()):
            return _to_fp32(args)
    return args


def fp32_compute_modules(root: nn.Module, policy: PrecisionPolicy) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` of every module that must compute in FP32 under ``policy``."""
    if policy.compute == "float32":
        return
    for path, module in root.named_modules():
        explicit = policy.match_module_rule(class_names(module), path)
        if explicit is not None:
            if explicit == "float32":
                yield path, module
            continue
        has_children = next(module.children(), None) is not None
        if module is not root and not has_children and policy.keeps_fp32(module, path):
            yield path, module


@dataclass
class ModulePolicyHandle:
    """The FP32 regions installed on a module tree; :meth:`remove` takes them all off.

    ``device_type``: the device type whose autocast the regions turn off (read at every call, so the plugin
    can follow the training device once it is known).
    """

    device_type: str = "cpu"
    paths: list[str] = field(default_factory=list)
    _wrapped: list[tuple[nn.Module, Any]] = field(default_factory=list)

    def add_region(self, module: nn.Module, path: str) -> None:
        """Make ``module`` (at ``path``) an FP32 region: autocast off, floating inputs cast to FP32.

        The module's ``forward`` is wrapped (an instance attribute, removed by
        :meth:`remove`) in a ``torch.autocast(enabled=False)`` block, which
        ``torch.compile`` traces like any other code.  A torch module of an
        autocast-neutral class (norms, embeddings, softmax: no op autocast
        lowers), unsubclassed, only gets its inputs cast: the same numbers
        without leaving and re-entering autocast.  A path that already is one is left alone.
        """
        if path in self.paths:
            return
        previous = module.__dict__.get("forward")
        inner = module.forward
        if type(module) in _AUTOCAST_NEUTRAL and getattr(inner, "__func__", None) is type(module).forward:

            @functools.wraps(inner)
            def forward(*args: Any, **kwargs: Any) -> Any:  # a neutral torch module: FP32 inputs suffice
                return inner(*_fp32_args(args), **(_to_fp32(kwargs) if kwargs else kwargs))
        else:

            @functools.wraps(inner)
            def forward(*args: Any, **kwargs: Any) -> Any:
                with torch.autocast(self.device_type, enabled=False):
                    return inner(*_fp32_args(args), **(_to_fp32(kwargs) if kwargs else kwargs))

        module.forward = forward  # type: ignore[method-assign]
        self._wrapped.append((module, previous))
        self.paths.append(path)

    def remove(self) -> None:
        """Restore every wrapped module's own ``forward``."""
        for module, previous in reversed(self._wrapped):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous  # type: ignore[method-assign]
        self._wrapped.clear()
        self.paths.clear()


def apply_module_policy(root: nn.Module, policy: PrecisionPolicy, device_type: str) -> ModulePolicyHandle:
    """Install FP32-region hooks on every module of ``root`` that the policy keeps in FP32."""
    handle = ModulePolicyHandle(device_type)
    for path, module in fp32_compute_modules(root, policy):
        handle.add_region(module, path)
    return handle


def cast_module_storage(
    root: nn.Module, policy: PrecisionPolicy, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Cast the parameters (and floating buffers) the policy does not keep in FP32 to ``dtype``.

    Returns ``{parameter name: FP32 copy of its value before the cast}`` for every
    parameter that was cast (the master weights start from the exact FP32
    values).  Parameters already stored in ``dtype`` get a FP32 copy of their
    current value.  Parameter objects are kept (only ``.data`` changes).
    """
    originals: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for path, module in root.named_modules():
        if policy.keeps_fp32(module, path):
            continue
        prefix = f"{path}." if path else ""
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.is_floating_point():
                continue
            seen.add(id(param))
            originals[prefix + name] = param.detach().to(torch.float32, copy=True)
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(module, name, buf.to(dtype))
    return originals


def restore_module_storage(root: nn.Module, originals: dict[str, torch.Tensor]) -> None:
    """Undo :func:`cast_module_storage`: every parameter named in ``originals`` gets that FP32 value back, and the
    module's floating buffers become FP32 again."""
    named = dict(root.named_parameters())
    with torch.no_grad():
        for name, value in originals.items():
            param = named.get(name)
            if param is not None:
                param.data = value.to(param.device)
    buffers_to_fp32(root)


def buffers_to_fp32(root: nn.Module) -> None:
    """Every floating buffer of ``root``'s modules that is not FP32 becomes FP32."""
    for module in root.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != torch.float32:
                setattr(module, name, buf.float())


def policy_report(root: nn.Module, policy: PrecisionPolicy) -> list[dict[str, str]]:
    """What the policy decided for every sub-module of ``root``: ``{"path", "class", "compute", "storage", "why"}``.

    ``compute`` is the dtype the module computes in, ``storage`` the dtype of
    the parameters it owns directly (``"-"`` when it owns none), ``why`` the
    rule that decided (:meth:`~mp_callbacks.policy.PrecisionPolicy.explain`).
    Format it with :func:`mp_callbacks.policy.format_report`.
    """
    rows = []
    for path, module in root.named_modules():
        if module is root:
            continue
        compute, why = policy.explain(module, path)
        if policy.compute == "float32":
            compute, why = "float32", "the recipe computes in float32"
        own = [p.dtype for p in module.parameters(recurse=False)]
        storage = str(own[0]).replace("torch.", "") if own else "-"
        rows.append({"path": path, "class": type(module).__name__, "compute": compute, "storage": storage,
                     "why": why})
    return rows
