"""``FSDPMixedPrecision``: the core's recipes as the precision plugin of Lightning's ``FSDPStrategy`` (FSDP1).

Lightning's ``FSDPStrategy`` accepts only an ``FSDPPrecision`` (a type check
in its ``precision_plugin`` setter) and builds FSDP1's ``MixedPrecision``
from the plugin's ``mixed_precision_config``.  This class is one:

* ``mixed_precision_config``: the core's sharded mapping
  (:func:`mp_callbacks.memory.sharded_dtypes`): ``*-master`` gathers in
  fp16/bf16 with the FP32 flat shards as the masters, ``*-mixed`` and
  ``32-true`` keep FP32 parameters (``*-mixed`` computes under autocast),
  gradients reduce in the recipe's ``comm_dtype``; buffers stay as they are;
* ``scaler``: the core's loss scaler (:class:`~lightning_ext.loss_scale.TorchLossScaler`,
  ``GradScaler``'s API, overflow flag all-reduced over every rank before the
  decision, as ``ShardedGradScaler``) for recipes that scale the loss, else None;
  ``FSDPPrecision.optimizer_step`` drives it;
* the module stays FP32 (FSDP1 keeps FP32 flat parameters; its
  ``MixedPrecision`` does the casts), inputs are not converted.

FSDP1 refuses the CPU, so its training path is not exercised here: the tests
cover construction, the type check and the config mapping only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from torch.nn import Module

from mp_callbacks.memory import sharded_dtypes
from mp_callbacks.recipes import Recipe, get_recipe

from ..loss_scale import TorchLossScaler, scaler_config_from
from ..policy import torch_dtype
from ..support import recipe_name

__all__ = ["FSDPMixedPrecision"]


class FSDPMixedPrecision(FSDPPrecision):
    """A recipe of :mod:`mp_callbacks` for ``Trainer(strategy=FSDPStrategy(...), plugins=[FSDPMixedPrecision(...)])``.

    Args:
      precision: a recipe name (``"bf16-master"``, ``"16-mixed"``...; not
        ``bf16-kahan``/``bf16-sr``, which have no sharded form).
      device: the device type of autocast under ``*-mixed`` (``"cuda"``).
      scaler: as :class:`lightning_ext.MixedPrecision`.
      policy: as :class:`lightning_ext.MixedPrecision`.
      comm_dtype: as :class:`lightning_ext.MixedPrecision`.
    """

    def __init__(self, precision: str = "bf16-mixed", device: str = "cuda", scaler: Any = None,
                 policy: Any = None, comm_dtype: str | None = None, divergence: Any = None) -> None:
        self.recipe: Recipe = get_recipe(recipe_name(precision), scaler=scaler_config_from(scaler), policy=policy,
                                         comm_dtype=comm_dtype)
        self.dtypes = sharded_dtypes(self.recipe)  # a recipe without a sharded form fails here
        self.precision = self.recipe.name  # type: ignore[assignment]
        self.device = str(device)
        self.loss_scaler = TorchLossScaler(self.recipe.scaler, divergence=divergence)
        self.scaler = self.loss_scaler if self.recipe.scaler.enabled else None  # type: ignore[assignment]
        self._desired_input_dtype = torch.float32

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, comm_dtype={self.recipe.comm_dtype!r})"

    @property
    def mixed_precision_config(self) -> Any:
        """torch FSDP1's ``MixedPrecision`` of the recipe (``param_dtype``, ``reduce_dtype``; buffers unchanged)."""
        from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

        as_torch = lambda name: None if name is None else torch_dtype(name)  # noqa: E731
        return TorchMixedPrecision(param_dtype=as_torch(self.dtypes.param_dtype),
                                   reduce_dtype=as_torch(self.dtypes.reduce_dtype), buffer_dtype=None)

    def convert_module(self, module: Module) -> Module:
        """Unchanged: FSDP1 shards the FP32 parameters (the masters) and casts its gathers."""
        return module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """No dtype change at init: parameters are created in FP32."""
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """No dtype change at init: parameters are created in FP32."""
        return contextlib.nullcontext()

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast in the compute dtype under ``*-mixed``; nothing otherwise (FSDP1 gathers ``*-master`` in it)."""
        if self.recipe.autocast:
            return torch.autocast(self.device, dtype=torch_dtype(self.recipe.policy.compute))
        return contextlib.nullcontext()

    def convert_input(self, data: Any) -> Any:
        """Inputs unchanged (FSDP1 casts the root's inputs to ``param_dtype``)."""
        return data

    def state_dict(self) -> dict[str, Any]:
        """The recipe name and the scaler record (plain data)."""
        return {"recipe": self.recipe.name, "comm_dtype": self.recipe.comm_dtype,
                "scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the scaler; another recipe is a ``StateDictError``)."""
        from mp_callbacks.recipes import plan_resume

        plan_resume(state_dict.get("recipe"), self.recipe)
        self.loss_scaler.load_state_dict(state_dict["scaler"])
