"""What the plugin trains with: recipe names, strategies and optimizers.

Supported, under the Trainer and under Fabric alike: single-device strategies, DDP (``ddp``, ``ddp_spawn``...),
``ModelParallelStrategy`` (FSDP2 ``fully_shard``, :mod:`lightning_ext.distributed.fsdp`),
and first-order optimizers.  FSDP1 (``FSDPStrategy``) takes
:class:`lightning_ext.FSDPMixedPrecision` instead; other strategies that
shard state or bring their own precision handling are refused with the
setting to use instead; so is LBFGS under any recipe but ``32-true`` (it
re-evaluates the closure inside ``step()``, which loss scaling, skipping and
masters cannot wrap).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import LBFGS

from mp_callbacks.recipes import RecipeError, canonical_recipe_name

__all__ = ["check_strategy"]

_UNSUPPORTED_STRATEGIES = {
    "DeepSpeedStrategy": "DeepSpeed's own fp16/bf16 config: Trainer(strategy='deepspeed', precision='16-mixed')",
    "FSDPStrategy": "lightning_ext.FSDPMixedPrecision(recipe) as the FSDP strategy's precision plugin, or "
                    "FSDP's mixed precision: Trainer(strategy='fsdp', precision='bf16-mixed')",
    "FabricFSDPStrategy": "ModelParallelStrategy (FSDP2) with this plugin, or FSDP's mixed precision: "
                          "Fabric(strategy='fsdp', precision='bf16-mixed')",
    "XLAStrategy": "Trainer(accelerator='tpu', precision='bf16-true')",
    "SingleDeviceXLAStrategy": "Trainer(accelerator='tpu', precision='bf16-true')",
}


def tensors_in(value: Any) -> Iterator[Tensor]:
    """Every tensor in a nested structure of tensors, mappings, lists and tuples."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def recipe_name(precision: Any) -> str:
    """The canonical recipe of ``MixedPrecision(precision=...)``; a ``RecipeError`` in the plugin's words."""
    try:
        return canonical_recipe_name(precision)
    except RecipeError as exc:
        hint = ""
        if isinstance(precision, str) and precision.endswith("-true") and precision != "32-true":
            hint = f" For Lightning's pure {precision} use Trainer(precision={precision!r})."
        raise RecipeError(f"Passed `MixedPrecision(precision={precision!r})`. Precision must be '16-mixed' or "
                          f"'bf16-mixed', or another lightning_ext recipe: {exc}.{hint}") from None


def is_sharded(strategy: Any) -> bool:
    """True under ``ModelParallelStrategy`` (FSDP2: the plugin follows :mod:`lightning_ext.distributed.fsdp`)."""
    return any(cls.__name__ == "ModelParallelStrategy" for cls in type(strategy).__mro__)


def is_fabric_strategy(strategy: Any) -> bool:
    """True for a Lightning Fabric strategy (one built on ``lightning.fabric.strategies``), False for a Trainer one."""
    return any(cls.__module__.startswith(("lightning.fabric.", "lightning_fabric.")) for cls in type(strategy).__mro__)


def _supported(fabric: bool) -> tuple[type, ...]:
    if fabric:
        from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
    else:
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    return SingleDeviceStrategy, DDPStrategy


def check_strategy(strategy: Any) -> None:
    """Raise ``MisconfigurationException`` when ``strategy`` (a Trainer's or a Fabric's) shards or re-implements
    precision handling."""
    if strategy is None or is_sharded(strategy):
        return
    fabric = is_fabric_strategy(strategy)
    for cls in type(strategy).__mro__:
        if cls.__name__ in _UNSUPPORTED_STRATEGIES:
            hint = _UNSUPPORTED_STRATEGIES.get(f"Fabric{cls.__name__}" if fabric else "",
                                               _UNSUPPORTED_STRATEGIES[cls.__name__])
            raise MisconfigurationException(
                f"lightning_ext.MixedPrecision does not support {type(strategy).__name__}: that strategy shards "
                f"parameters or optimizer state and brings its own precision handling. Use "
                f"{hint.replace('Trainer(', 'Fabric(') if fabric else hint}, or keep this plugin with "
                "strategy='ddp' / a single device."
            )
    if not isinstance(strategy, _supported(fabric)):
        raise MisconfigurationException(
            f"lightning_ext.MixedPrecision supports single-device, DDP and ModelParallelStrategy (FSDP2), not "
            f"{type(strategy).__name__}. Use strategy='ddp' (or 'ddp_spawn'), or the strategy's own precision."
        )


def check_optimizer(optimizer: Any, recipe: str) -> None:
    """Raise ``MisconfigurationException`` for LBFGS under a recipe other than ``32-true``."""
    if isinstance(optimizer, LBFGS) and recipe != "32-true":
        raise MisconfigurationException(
            f"lightning_ext.MixedPrecision({recipe!r}) does not support LBFGS: it re-evaluates "
            "the closure inside step(), so loss scaling, overflow skipping and master weights cannot wrap "
            "it. Use a first-order optimizer (SGD, Adam, AdamW) with this recipe, or "
            "MixedPrecision('32-true') / Trainer(precision='32-true') for LBFGS.")


def autocast_device(strategy: Any, device: Any, device_type: str) -> str:
    """The device type autocast runs on: the strategy's training device (a warning when the plugin's
    ``device`` said another), else ``device_type``."""
    root = getattr(strategy, "root_device", None)
    if isinstance(root, torch.device) and root.type != device_type:
        warnings.warn(
            f"MixedPrecision(device={device!r}) but the model trains on {root}: autocast follows the "
            f"training device, {root.type!r}. Pass device={root.type!r} to silence this warning.", stacklevel=4)
        return root.type
    return device_type


def cast_floats(data: Any, dtype: Any) -> Any:
    """``data`` with every floating tensor in it (nested collections too) cast to ``dtype``."""
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)
