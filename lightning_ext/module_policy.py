"""Apply a :class:`~mp_callbacks.policy.PrecisionPolicy` to a ``torch.nn.Module`` tree.

The policy decides (:meth:`PrecisionPolicy.resolve`); this module only
translates the decision into torch mechanics:

* **FP32 modules** (norms, softmax, losses, embeddings, unknown custom leaves,
  and anything an explicit module rule maps to ``float32``) run with autocast
  disabled and their floating inputs cast to float32, through a forward
  pre-hook / forward hook pair (the hook that closes the autocast region is
  registered with ``always_call=True``, so an exception inside ``forward``
  still closes it).
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

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from mp_callbacks.policy import PrecisionPolicy

__all__ = ["ModulePolicyHandle", "apply_module_policy", "cast_module_storage", "fp32_compute_modules", "torch_dtype"]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    return _TORCH_DTYPES[name]


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float32 else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to_fp32(v)) for k, v in value.items())
    return value


def fp32_compute_modules(root: nn.Module, policy: PrecisionPolicy) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` of every module that must compute in FP32 under ``policy``."""
    if policy.compute == "float32":
        return
    for path, module in root.named_modules():
        explicit = policy.match_module_rule(type(module).__name__, path)
        if explicit is not None:
            if explicit == "float32":
                yield path, module
            continue
        has_children = next(module.children(), None) is not None
        if module is not root and not has_children and policy.keeps_fp32(module, path):
            yield path, module


@dataclass
class ModulePolicyHandle:
    """The hooks installed on a module tree; :meth:`remove` takes them all off."""

    handles: list[Any] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    def add_region(self, module: nn.Module, path: str, device_type: str) -> None:
        """Make ``module`` (at ``path``) an FP32 region: autocast off, floating inputs cast to FP32.

        A path that already is one is left alone.
        """
        if path in self.paths:
            return
        region = _Fp32Region(device_type)
        self.handles.append(module.register_forward_pre_hook(region.pre_hook, with_kwargs=True))
        self.handles.append(module.register_forward_hook(region.post_hook, with_kwargs=True, always_call=True))
        self.paths.append(path)

    def remove(self) -> None:
        """Remove every hook this handle installed."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.paths.clear()


class _Fp32Region:
    """Forward pre-hook + forward hook pair: autocast off and FP32 inputs inside one module."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._stack: list[torch.autocast] = []

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ctx = torch.autocast(self.device_type, enabled=False)
        ctx.__enter__()
        self._stack.append(ctx)
        return _to_fp32(args), _to_fp32(kwargs)

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._stack:
            self._stack.pop().__exit__(None, None, None)
        return None


def apply_module_policy(root: nn.Module, policy: PrecisionPolicy, device_type: str) -> ModulePolicyHandle:
    """Install FP32-region hooks on every module of ``root`` that the policy keeps in FP32."""
    handle = ModulePolicyHandle()
    for path, module in fp32_compute_modules(root, policy):
        handle.add_region(module, path, device_type)
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
                module._buffers[name] = buf.to(dtype)
    return originals
