"""The plugin under Lightning's ``ModelParallelStrategy`` (torch FSDP2, ``fully_shard``).

The core decides what a recipe means when sharded
(:func:`mp_callbacks.memory.sharded_dtypes`); this module translates:

* :func:`fsdp_policy`: the recipe as torch's ``MixedPrecisionPolicy``
  (``plugin.fsdp_policy(module)`` in ``configure_model``); a module the
  op policy keeps in FP32 (norms...) gathers FP32;
* :func:`fully_shard_model`: ``fully_shard`` applied the way the recipe needs
  (FP32-kept modules with parameters first, then the given units, then the root; under
  ``fp8={"fsdp_float8_all_gather": True}`` the FP8 Linear weights get their FP8 all-gather hooks
  first: :func:`prepare_fp8_all_gather`, :mod:`lightning_ext.fp8.allgather`);
* :func:`inspect_sharded`: at setup, what the model was sharded with, checked
  against the recipe (a mismatch is an error naming the parameter and the fix);
* :class:`ShardedLayout`: what the plugin and the monitor need afterwards:
  the gather dtype of every sharded parameter, the shard count, per-rank
  memory (:meth:`ShardedLayout.memory_report`) and the meter reduction over
  ranks (:meth:`ShardedLayout.reduce_meters`: one all-reduce).

Under ``*-master`` the sharded FP32 parameters ARE the master weights: the
plugin keeps no second copy, the optimizer updates the FP32 shards (its
states are FP32 shards), and FSDP2 casts them to bf16/fp16 when it gathers a
unit for compute.  The loss scaler's overflow check runs on each rank's
gradient shards and its flag is all-reduced (MAX) over every rank before the
decision (:class:`~lightning_ext.loss_scale.TorchLossScaler`): torch's
``ShardedGradScaler`` semantics, every rank skips together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from mp_callbacks.dtypes import canonical_dtype
from mp_callbacks.memory import MemoryEstimate, ShardedDtypes, is_optimizer_state, memory_report, sharded_dtypes
from mp_callbacks.policy import class_names

from ..fp8 import fp8_modules
from ..fp8.allgather import wrap_weights
from ..policy import torch_dtype

__all__ = ["ShardedLayout", "fsdp_policy", "fully_shard_model", "inspect_sharded", "local", "prepare_fp8_all_gather"]

_SUMMED = ("underflow_lost", "underflow_total", "swamp_lost", "swamp_total")
"""Monitor slots that are counts over each rank's shards: summed over ranks."""


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard (the tensor itself otherwise); shares storage, no communication."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


def _keeps_fp32(recipe: Any, module: nn.Module | None, path: str) -> bool:
    """Whether ``module``'s own parameters stay FP32 (the storage rule of ``cast_module_storage``)."""
    return module is not None and recipe.low_precision and recipe.policy.keeps_fp32(module, path)


def _unit_keeps_fp32(recipe: Any, module: nn.Module | None, path: str) -> bool:
    """A sharding unit gathers FP32 when every module in it that owns parameters stays FP32 (a norm);
    a container of linears and norms gathers low (shard its norms as their own units)."""
    if module is None or not recipe.low_precision:
        return False
    owners = [(".".join(x for x in (path, sub) if x), m) for sub, m in module.named_modules()
              if any(True for _ in m.parameters(recurse=False))]
    return bool(owners) and all(_keeps_fp32(recipe, m, q) for q, m in owners)


def _dtypes(recipe: Any, module: nn.Module | None, path: str, root: bool, owner: bool = False) -> ShardedDtypes:
    keeps = _keeps_fp32(recipe, module, path) if owner else _unit_keeps_fp32(recipe, module, path)
    try:
        return sharded_dtypes(recipe, keeps, root)
    except ValueError as exc:
        raise MisconfigurationException(f"lightning_ext.MixedPrecision under FSDP2: {exc}") from None


def fsdp_policy(recipe: Any, module: nn.Module | None = None, path: str = "", root: bool | None = None) -> Any:
    """torch's ``MixedPrecisionPolicy`` for ``recipe`` (for ``module`` at ``path``, when given).

    ``root``: whether the module is the outermost sharded one (its outputs get
    the policy's output dtype under ``*-master``); default: True without a module.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    want = _dtypes(recipe, module, path, module is None if root is None else root)
    as_torch = lambda name: None if name is None else torch_dtype(name)  # noqa: E731
    return MixedPrecisionPolicy(param_dtype=as_torch(want.param_dtype), reduce_dtype=as_torch(want.reduce_dtype),
                                output_dtype=as_torch(want.output_dtype))


def fully_shard_model(model: nn.Module, recipe: Any, mesh: Any = None, units: Sequence[Any] = (),
                      **kwargs: Any) -> nn.Module:
    """``fully_shard`` ``model`` for ``recipe``: FP32-kept modules that own parameters (own units, FP32
    gathers), then every module whose class (or a base class) is named in ``units`` (names or classes),
    then ``model`` itself; ``kwargs`` go to every ``fully_shard`` call (``reshard_after_forward``...).

    ``recipe``: a :class:`~mp_callbacks.recipes.Recipe`, or the plugin itself: under Fabric pass the plugin (in
    ``ModelParallelStrategy``'s ``parallelize_fn``), which first gives the parameters back the FP32 values its
    ``convert_module`` stored in low precision (``plugin.prepare_sharding(model)``)."""
    from torch.distributed.fsdp import fully_shard

    if hasattr(recipe, "prepare_sharding"):
        recipe.prepare_sharding(model)
        recipe = recipe.recipe
    prepare_fp8_all_gather(model, recipe)
    names = {u if isinstance(u, str) else u.__name__ for u in units}
    todo = []
    for path, sub in model.named_modules():
        if sub is model:
            continue
        owns = any(True for _ in sub.parameters(recurse=False))
        if (owns and _keeps_fp32(recipe, sub, path)) or names & set(class_names(sub)):
            todo.append((path, sub))
    for path, sub in reversed(todo):  # inner modules before the units holding them
        fully_shard(sub, mesh=mesh, mp_policy=fsdp_policy(recipe, sub, path, root=False), **kwargs)
    return fully_shard(model, mesh=mesh, mp_policy=fsdp_policy(recipe), **kwargs)


def prepare_fp8_all_gather(model: nn.Module, recipe: Any, policy: Any = None) -> list[str]:
    """Under ``fp8={"fsdp_float8_all_gather": True}``: before ``fully_shard``, give the weight of every FP8
    ``nn.Linear`` of ``model`` (:func:`lightning_ext.fp8.fp8_modules` under ``policy``, default the recipe's)
    the FP8 all-gather hooks (:mod:`lightning_ext.fp8.allgather`); returns their paths (none without the
    setting).  :func:`fully_shard_model` calls it; call it yourself when you call ``fully_shard``."""
    fp8 = getattr(recipe, "fp8", None)
    if fp8 is None or not fp8.fsdp_float8_all_gather:
        return []
    chosen = fp8_modules(model, policy if policy is not None else recipe.policy)
    try:
        return wrap_weights((p, m) for p, m in chosen if isinstance(m, nn.Linear))
    except ValueError as exc:
        raise MisconfigurationException(f"lightning_ext.MixedPrecision({recipe.name!r}): {exc}") from None


@dataclass
class ShardedLayout:
    """What the model was sharded with: gather dtype per sharded parameter, shard count."""

    n_shards: int
    gather_dtypes: dict[int, str] = field(default_factory=dict)  # id(sharded param) -> dtype name

    # -------------------------------------------------------------- memory
    def memory_report(self, recipe: Any, module: nn.Module, optimizers: Iterable[Any]) -> dict[str, Any]:
        """One rank's model state (local shards' bytes) next to ``estimate_memory(..., n_shards)``.

        A parameter gathered in low precision is its own FP32 master (counted in
        ``masters``, as the estimate does); grads and optimizer states are the local shards.
        """
        from ..loss_scale import unwrap_optimizer
        from ..support import tensors_in

        params = list({id(p): p for p in module.parameters()}.values())
        weights = masters = grads = state = 0
        for p in params:
            held = local(p).nbytes
            if self.gather_dtypes.get(id(p), "float32") != "float32":
                masters += held
            else:
                weights += held
            grads += local(p.grad).nbytes if p.grad is not None else 0
        rows = []
        for opt in optimizers:
            raw = unwrap_optimizer(opt)
            opt_params = [p for g in raw.param_groups for p in g["params"]]
            for slot in raw.state.values():
                state += sum(local(v).nbytes for v in tensors_in(slot) if is_optimizer_state(v.shape))
            momentum = max((float(g.get("momentum", 0) or 0) for g in raw.param_groups), default=0.0)
            rows.append((type(raw).__name__, momentum,
                         [(p.numel(), self.gather_dtypes.get(id(p), canonical_dtype(p.dtype))) for p in opt_params]))
        actual = MemoryEstimate(params=sum(p.numel() for p in params), weights=weights, grads=grads,
                                masters=masters, optimizer_state=state)
        return memory_report(recipe.name, recipe.master, rows, actual, n_shards=self.n_shards)

    # -------------------------------------------------------------- meters
    @staticmethod
    def reduce_meters(names: Sequence[str], values: list[Tensor]) -> list[Tensor]:
        """The monitor's per-rank meter values made global with ONE all-reduce (SUM).

        ``grad_norm`` (of the local shards) is squared, summed and rooted; the
        element counts of the underflow and swamping meters are summed; the
        other slots (scale, counters, overflow flag, loss) are the same on
        every rank or rank-local (the loss) and pass through.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return values
        picks = [i for i, n in enumerate(names) if n == "grad_norm" or n in _SUMMED]
        if not picks:
            return values
        device = values[picks[0]].device
        packed = torch.stack([values[i].detach().reshape(()).to(device=device, dtype=torch.float64) ** (
            2 if names[i] == "grad_norm" else 1) for i in picks])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        out = list(values)
        for k, i in enumerate(picks):
            out[i] = packed[k].sqrt() if names[i] == "grad_norm" else packed[k]
        return out


def inspect_sharded(module: nn.Module, recipe: Any) -> ShardedLayout:
    """Check how ``module`` was sharded against ``recipe``; return its :class:`ShardedLayout`.

    Every FSDP2 parameter must gather and reduce in the recipe's dtypes
    (:func:`fsdp_policy`; FP32-kept modules gather FP32), be stored in FP32
    (the shard is the master), and under ``*-master`` every trainable
    parameter must be sharded.  Violations are one ``MisconfigurationException``
    listing them with the fix.
    """
    from torch.distributed.fsdp import FSDPModule

    _dtypes(recipe, None, "", True)  # recipes with no sharded form fail here
    paths = {id(m): p for p, m in module.named_modules()}
    layout = ShardedLayout(n_shards=1)
    problems: list[str] = []
    for _, sub in module.named_modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = sub._get_fsdp_state()._fsdp_param_group
        policy = group.mp_policy if group is not None else None
        for fp in (group.fsdp_params if group is not None else []):
            owner = fp._module_info.module
            path = paths.get(id(owner), "")
            name = f"{path}.{fp._module_info.param_name}" if path else fp._module_info.param_name
            want = _dtypes(recipe, owner, path, True, owner=True)
            orig = canonical_dtype(fp.sharded_param.dtype)  # FSDP2's own dtype attributes exist after lazy init
            gather = canonical_dtype(policy.param_dtype or fp.sharded_param.dtype)
            reduce = canonical_dtype(policy.reduce_dtype or gather)
            if orig != "float32":
                problems.append(f"{name} is stored in {orig}: keep the model in FP32 before fully_shard (under "
                                "*-master the FP32 shards are the masters)")
            elif (gather, reduce) != (want.param_dtype or "float32", want.reduce_dtype):
                problems.append(f"{name} gathers in {gather} and reduces in {reduce}; recipe {recipe.name!r} "
                                f"(comm_dtype={recipe.comm_dtype!r}) needs {want.param_dtype or 'float32'} and "
                                f"{want.reduce_dtype}")
            layout.gather_dtypes[id(fp.sharded_param)] = gather
            layout.n_shards = max(layout.n_shards, fp.sharded_param.device_mesh.size())
    if recipe.master.master_weights:
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in layout.gather_dtypes:
                problems.append(f"{name} is not sharded: under {recipe.name!r} the FP32 shards are the masters, so "
                                "every trainable parameter must be in a fully_shard unit (shard the root too)")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise MisconfigurationException(
            f"lightning_ext.MixedPrecision({recipe.name!r}) under ModelParallelStrategy: {shown}. In configure_model "
            "use fully_shard(m, mp_policy=self.trainer.precision_plugin.fsdp_policy(m)) per unit, or "
            "lightning_ext.fully_shard_model(model, self.trainer.precision_plugin.recipe, mesh); under Fabric, "
            "fully_shard_model(model, plugin, mesh) in the parallelize_fn (or plugin.prepare_sharding(model) before "
            "fully_shard).")
    return layout
