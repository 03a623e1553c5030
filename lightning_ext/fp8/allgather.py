"""FP8 all-gather under FSDP2 (``fp8={"fsdp_float8_all_gather": True}``): the tensor-subclass hooks.

The rule is the core's (:mod:`mp_callbacks.fp8.allgather`): the weight of every FP8 ``nn.Linear``
is all-gathered as e4m3 bytes, each rank casting its FP32 shard with the weight's one scale (the
committed state's under delayed scaling; under current scaling from the weight's global amax, an
all-reduce MAX of the shards' amaxes), and the FP8 matmul uses the gathered bytes and scale as they
are.  FSDP2 lets a parameter's local tensor choose what is gathered (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, as torchao's ``WeightWithDynamicFloat8CastTensor``):

* :class:`FP8AllGatherWeight`: the sharded FP32 weight (same values, every op runs on them).  Before
  a gather it casts the shard with :meth:`lightning_ext.fp8.TorchFP8.quantize` (the amax recorded
  for the step as on one device) and pads it to FSDP2's padded shard; the bytes travel as ``uint8``
  (any backend gathers bytes).  A weight no FP8 matmul uses gathers in the compute dtype.
* :class:`FP8GatheredWeight`: the unsharded weight, FP8 data and ``scale_inv``, reporting the
  compute dtype.  :func:`gathered_parts` hands both to the FP8 matmul; any other op reads the
  dequantized values (``data * scale_inv`` in the compute dtype).

:func:`wrap_weights` puts the sharded class in place before ``fully_shard`` (FSDP2 looks for the
hooks when it shards; :func:`lightning_ext.distributed.fully_shard_model` and
:func:`lightning_ext.distributed.prepare_fp8_all_gather` call it); :func:`link_weight` ties a weight to its
FP8 matmul when the plugin installs them (after sharding).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from mp_callbacks.fp8 import FP8_GATHER_ROLE, gather_reduces_amax

__all__ = ["FP8AllGatherWeight"]


@dataclass
class _Link:
    """What a weight's sharded tensors share (FSDP2 copies them through pad, slice and view)."""

    path: str
    fp8: Any = None  # the TorchFP8 whose matmul ``index`` uses this weight (set at install)
    index: int = -1
    gathered_fp8: bool | None = None  # what the first gather sent: fixed from then on (FSDP2's buffers are)


_PRESERVED = {  # ops whose outputs FSDP2 keeps as the sharded weight (torchao's list)
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
}


class FP8AllGatherWeight(Tensor):
    """A sharded FP32 weight that FSDP2 all-gathers as FP8 bytes (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _tensor: Tensor
    _link: _Link

    @staticmethod
    def __new__(cls, tensor: Tensor, link: _Link) -> FP8AllGatherWeight:
        return Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor, link: _Link) -> None:
        self._tensor, self._link = tensor, link

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        links = [t._link for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)]
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        return pytree.tree_map_only(Tensor, lambda t: cls(t, links[0]), out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], self._link

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], link: _Link, size: Any, stride: Any) -> FP8AllGatherWeight:
        return FP8AllGatherWeight(inner["_tensor"], link)

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self._link.path!r}, {self._tensor!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``, distributed checkpoints) as the plain FP32 tensor it holds: a checkpoint
        loads with or without FP8 all-gather (and with ``weights_only=True``)."""
        return self._tensor.__reduce_ex__(protocol)

    # ------------------------------------------------------------------ FSDP2's hooks
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[Tensor, ...], Any]:
        """The shard to gather: its e4m3 cast as bytes (FP8 matmul weights) or its compute-dtype copy,
        padded to FSDP2's shard of ``ceil(rows / shards)`` rows; the metadata is the ``scale_inv``."""
        link, x = self._link, self._tensor
        fp8 = link.fp8 if link.fp8 is not None and link.fp8.recipe.fsdp_float8_all_gather else None
        if link.gathered_fp8 is None:
            link.gathered_fp8 = fp8 is not None
        elif link.gathered_fp8 != (fp8 is not None):
            first = "in FP8" if link.gathered_fp8 else "in the compute dtype"
            raise RuntimeError(f"{link.path}.weight was first all-gathered {first} and FSDP2 keeps that buffer: its "
                               "FP8 matmul cannot be added or removed after the first step (keep_in_fp32 before "
                               "fully_shard)")
        rows = -(-int(outer_size[0]) // mesh.size())
        if fp8 is None:
            data, meta = x.to(mp_policy.param_dtype or x.dtype), None
        else:
            amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
            if gather_reduces_amax(fp8.configs[FP8_GATHER_ROLE]):  # this step's scale: the weight's global amax
                torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
            q, meta = fp8.quantize(FP8_GATHER_ROLE, link.index, x, torch.is_grad_enabled(), amax=amax)
            data = q.view(torch.uint8)
        if data.shape[0] != rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), meta

    def fsdp_post_all_gather(self, outputs: tuple[Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        """The unsharded weight: an :class:`FP8GatheredWeight` over the gathered bytes (or the plain
        gathered tensor); with ``out`` (later gathers refill the same buffer) only its scale changes."""
        (data,) = outputs
        if metadata is None:
            return None if out is not None else (data, (data,))
        if out is not None:
            out._scale_inv = metadata  # type: ignore[attr-defined]
            return None
        dtype = self._link.fp8._fp8_dtypes[FP8_GATHER_ROLE]
        return FP8GatheredWeight(data.view(dtype), metadata, param_dtype), (data,)


_VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
          torch.ops.aten.as_strided.default, torch.ops.aten._unsafe_view.default}


class FP8GatheredWeight(Tensor):
    """An unsharded weight as FP8 data and its float32 ``scale_inv``, of the compute dtype ``dtype``."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _data: Tensor
    _scale_inv: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> FP8GatheredWeight:
        return Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            layout=data.layout, device=data.device, requires_grad=False)

    def __init__(self, data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale_inv = data, scale_inv

    def dequantize(self) -> Tensor:
        """``data * scale_inv`` in float32, then the compute dtype (what any op but the FP8 matmul reads)."""
        return (self._data.float() * self._scale_inv).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _VIEWS and isinstance(args[0], cls):
            src = args[0]
            return cls(func(src._data, *args[1:], **kwargs), src._scale_inv, src.dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], dtype: torch.dtype, size: Any, stride: Any) -> FP8GatheredWeight:
        return FP8GatheredWeight(inner["_data"], inner["_scale_inv"], dtype)

    def __repr__(self) -> str:
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, scale_inv={self._scale_inv!r}, dtype={self.dtype})"


# ---------------------------------------------------------------------- helpers
def gathered_parts(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(FP8 data, scale_inv)`` of a weight FSDP2 gathered in FP8, else None."""
    if isinstance(weight, FP8GatheredWeight):
        return weight._data, weight._scale_inv
    return None


def local_weight(module: nn.Module) -> Tensor | None:
    """``module.weight``'s local tensor (a sharded DTensor's shard), or None without a weight."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return None
    return weight._local_tensor if hasattr(weight, "_local_tensor") else weight


def wrap_weights(modules: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Make each ``(path, Linear)``'s FP32 weight an :class:`FP8AllGatherWeight` (before ``fully_shard``);
    returns the paths.  Already wrapped weights stay as they are."""
    paths = []
    for path, module in modules:
        weight = module.weight
        if not isinstance(local_weight(module), FP8AllGatherWeight):
            if hasattr(weight, "_local_tensor"):
                raise ValueError(f"{path or 'the model'}.weight is sharded already: prepare FP8 all-gather before "
                                 "fully_shard (FSDP2 looks for the all-gather hooks when it shards)")
            module.weight = nn.Parameter(FP8AllGatherWeight(weight.data, _Link(path)),
                                         requires_grad=weight.requires_grad)
        paths.append(path)
    return paths


def link_weight(module: nn.Module, fp8: Any, index: int) -> bool:
    """Tie ``module``'s FP8-gathered sharded weight to FP8 matmul ``index`` of ``fp8`` (``None``: untie);
    False when its weight is not an FSDP2-sharded :class:`FP8AllGatherWeight`."""
    weight = module.weight
    local = local_weight(module)
    if not (hasattr(weight, "_local_tensor") and isinstance(local, FP8AllGatherWeight)):
        return False
    local._link.fp8, local._link.index = fp8, index
    return True
