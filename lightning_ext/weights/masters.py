"""FP32 master weights inside torch optimizers (the ``*-master`` recipes).

The core's rule (:mod:`mp_callbacks.memory.estimate`): a parameter stored in fp16/bf16
gets an FP32 master; the optimizer updates the master (its param group holds
the master, so its states are FP32); after every *applied* step the master is
rounded back into the low-precision parameter.  Parameters kept in FP32 are
their own master.  :class:`MasterWeights` is that rule in torch:

* :meth:`record_originals` keeps the FP32 values the model had before its
  storage was cast (the masters start from them, not from rounded weights);
* :meth:`install` swaps masters into the optimizers' param groups (moving any
  existing optimizer state onto them; under DDP the masters follow rank 0);
* :meth:`collect_grads` (:meth:`grads_to_masters`) makes each low-precision gradient its
  master's FP32 gradient and releases the low one, before the overflow check;
* :meth:`updating` wraps ``optimizer.step()``: the low-precision weights'
  storage is released while the step runs (nothing reads them), the user's
  optimizer steps the masters as torch wrote it (``AdamW(fused=True)`` or
  ``foreach=True`` is the user's choice for speed), the spent FP32 gradients
  are dropped after it, and the weights are rebuilt from the masters, also
  when the step raises;
* :meth:`state_dict` / :meth:`load_state_dict`: ``{parameter name: master}``.

``remainders=True`` (``master_remainders``, :mod:`mp_callbacks.weights.remainders`): between steps
each master is held as its bf16 weight plus an int16 remainder (the master
parameter keeps its shape, its storage is released).  :meth:`updating` rebuilds
the exact FP32 master of each parameter in place of its remainder (and weight)
for the step and splits it back after; :meth:`value` / :meth:`value_of` read a
master at any time (joined), so checkpoints, meters and FP32 moves see the FP32
master.  A parameter whose bf16 weight is not contiguous keeps an FP32 copy.

It is one of the plugin's two weight stores (:func:`lightning_ext.weights.weight_store`):
:class:`~lightning_ext.weights.rounding.UpdateRounding` has the same interface
(``record_originals``, ``restore_originals``, ``install``, ``collect_grads``, ``step``,
``store_fp32``, ``state_dict``/``load_state_dict``, ``clear_cache``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from mp_callbacks.settings import StateDictError

from ..policy import buffers_to_fp32, restore_module_storage
from .remainders import join_into, joined, split_into

__all__ = ["MasterEntry", "MasterWeights"]


class MasterEntry(NamedTuple):
    """One low-precision parameter and its FP32 master."""

    name: str
    low: nn.Parameter
    master: nn.Parameter


class MasterWeights:
    """The FP32 masters of one model's low-precision parameters, per optimizer.

    Args:
      free_weights_during_step: release the low-precision weights' storage
        while the optimizer steps (see :meth:`updating`).
      remainders: hold each master as bf16 weight + int16 remainder between steps
        (the same exact FP32 master, 2 B/param less; see the module docstring).
    """

    keeps_masters = True
    """FP32 copies of the weights (under FSDP2 the sharded FP32 parameters are the masters: not installed)."""

    def __init__(self, free_weights_during_step: bool = True, remainders: bool = False) -> None:
        self.free_weights_during_step = bool(free_weights_during_step)
        self.remainders = bool(remainders)
        self._rems: dict[int, Tensor] = {}  # id(master) -> int16 remainder (remainders only)
        self._held: set[int] = set()  # id(master) of masters held as remainders now (storage released)
        self._low_of: dict[int, Tensor] = {}  # id(master) -> its low-precision weight (remainders only)
        self._entries: dict[int, MasterEntry] = {}  # id(low-precision param) -> entry
        self._by_optimizer: dict[int, tuple[Any, list[MasterEntry]]] = {}
        self._originals: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[MasterEntry]:
        """Every entry, in installation order."""
        return list(self._entries.values())

    def master_of(self, param: Tensor) -> nn.Parameter | None:
        """The FP32 master of low-precision ``param`` (None: it has none)."""
        entry = self._entries.get(id(param))
        return entry.master if entry is not None and entry.low is param else None

    def value(self, entry: MasterEntry) -> Tensor:
        """The FP32 master of ``entry`` (joined from weight + remainder while it is held as one)."""
        if id(entry.master) in self._held:
            return joined(entry.low, self._rems[id(entry.master)])
        return entry.master.detach()

    def value_of(self, param: Tensor) -> Tensor:
        """The FP32 value of an optimizer parameter: its joined master, or the parameter itself."""
        if id(param) in self._held:
            return joined(self._low_of[id(param)], self._rems[id(param)])
        return param.detach()

    def held_nbytes(self, param: Tensor) -> int:
        """Bytes an optimizer parameter holds now: a remainder master's remainder, else its own."""
        if id(param) in self._held:
            return self._rems[id(param)].nbytes
        return param.nbytes

    # -------------------------------------------------------------- install
    def record_originals(self, module: nn.Module, originals: Mapping[str, Tensor]) -> None:
        """Remember the FP32 values of parameters whose storage was just cast (``{name: fp32 value}``).

        A parameter that already has a master whose rounding equals its current
        value keeps the master's value (a later fit keeps the earlier fit's precision).
        """
        named = dict(module.named_parameters())
        for name, fp32 in originals.items():
            param = named.get(name)
            entry = self._entries.get(id(param)) if param is not None else None
            if entry is not None and entry.low is param and self._rounds_to(entry, param):
                fp32 = self.value(entry).clone()
            self._originals[name] = fp32

    def _rounds_to(self, entry: MasterEntry, param: Tensor) -> bool:
        """Whether ``param`` holds the forward weight of ``entry``'s master (the user did not change it)."""
        if id(entry.master) in self._held:  # the weight is the forward half itself
            low = torch.empty_like(param)
            split_into(self.value(entry), low, torch.empty(param.shape, dtype=torch.int16, device=param.device))
            return torch.equal(low, param.detach())
        return torch.equal(entry.master.detach().to(param.dtype), param.detach())

    def restore_originals(self, root: nn.Module) -> None:
        """Undo the storage cast :meth:`record_originals` saw (``root``'s parameters get their FP32 values back)
        and forget it: the model is about to be sharded, whose FP32 shards need no copy."""
        restore_module_storage(root, self._originals)
        self._originals.clear()

    def install(self, root: nn.Module, optimizers: Iterable[Optimizer]) -> None:
        """Put an FP32 master in place of every low-precision parameter of the optimizers' param groups."""
        self._rebuild(list(self._entries.values()))  # a later fit: masters in FP32 while installing
        names = {id(p): n for n, p in root.named_parameters()}
        pending = self._pending or {}
        for opt in optimizers:
            for group in opt.param_groups:
                params = group["params"]
                for i, p in enumerate(params):
                    if p.dtype == torch.float32:
                        continue
                    entry = self._entries.get(id(p))
                    if entry is None or entry.low is not p:
                        entry = self._new_entry(names.get(id(p), f"<unnamed {len(self._entries)}>"), p, pending)
                        self._entries[id(p)] = entry
                    else:  # a later fit: the recorded FP32 value (the master itself unless the user changed it)
                        fresh = pending.get(entry.name, self._originals.pop(entry.name, None))
                        if fresh is not None:
                            with torch.no_grad():
                                entry.master.copy_(fresh)
                    params[i] = entry.master
                    if p in opt.state:  # existing optimizer state moves onto the master, in FP32
                        opt.state[entry.master] = {
                            k: (v.float() if isinstance(v, Tensor) and v.is_floating_point() and v.dim() else v)
                            for k, v in opt.state.pop(p).items()
                        }
        self._pending = None
        self._by_optimizer.clear()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():  # DDP broadcast rank 0's weights: the masters follow rank 0 too
                for entry in self._entries.values():
                    dist.broadcast(entry.master.data, src=0)
        self._write_back(list(self._entries.values()))

    def _new_entry(self, name: str, p: nn.Parameter, pending: Mapping[str, Tensor]) -> MasterEntry:
        original = self._originals.pop(name, None)
        value = pending.get(name, original)
        if value is None:
            value = p.detach().float()
        value = value.detach().to(device=p.device, dtype=torch.float32)
        if self.remainders and p.is_contiguous():  # its own contiguous storage: released between steps
            value = value.clone(memory_format=torch.contiguous_format)
        elif value is not original:
            value = value.clone()
        return MasterEntry(name, p, nn.Parameter(value, requires_grad=p.requires_grad))

    def for_optimizer(self, optimizer: Optimizer) -> list[MasterEntry]:
        """The entries whose master ``optimizer`` updates (cached while its param groups keep their layout)."""
        groups = optimizer.param_groups
        key = (len(self._entries), len(groups), tuple(id(g["params"]) for g in groups),
               sum(len(g["params"]) for g in groups))
        cached = self._by_optimizer.get(id(optimizer))
        if cached is not None and cached[0] == key:
            return cached[1]
        in_opt = {id(p) for g in groups for p in g["params"]}
        entries = [e for e in self._entries.values() if id(e.master) in in_opt]
        self._by_optimizer[id(optimizer)] = (key, entries)
        return entries

    # ------------------------------------------------------------ per step
    @staticmethod
    def grads_to_masters(entries: Iterable[MasterEntry]) -> None:
        """Each low-precision gradient becomes its master's FP32 gradient; the low one is released."""
        reuse_dst, reuse_src = [], []
        for _, low, master in entries:
            if low.grad is None:
                continue
            if master.grad is None or master.grad.shape != master.shape or master.grad.dtype != torch.float32:
                master.grad = low.grad.to(torch.float32)
            else:
                reuse_dst.append(master.grad)
                reuse_src.append(low.grad)
            low.grad = None
        if reuse_dst:
            torch._foreach_copy_(reuse_dst, reuse_src)

    @staticmethod
    def copy_to_params(entries: Iterable[MasterEntry]) -> None:
        """Round every master into its low-precision parameter (one fused copy)."""
        lows, masters = [], []
        for _, low, master in entries:
            lows.append(low)
            masters.append(master)
        if lows:
            with torch.no_grad():
                torch._foreach_copy_(lows, masters)

    def collect_grads(self, optimizer: Optimizer) -> None:
        """Before the overflow check: ``optimizer``'s low-precision gradients become its masters' FP32 ones."""
        if self._entries:
            self.grads_to_masters(self.for_optimizer(optimizer))

    def step(self, optimizer: Optimizer, stepper: Any = None, **kwargs: Any) -> Any:
        """``optimizer.step()`` on the masters, then the weights rounded from them (:meth:`updating`).

        ``stepper``: an :class:`~lightning_ext.weights.low_bit.EightBitAdamW` of ``optimizer`` (``state_dtype="8bit"``),
        whose ``step()`` runs instead.
        """
        with self.updating(optimizer) if self._entries else contextlib.nullcontext():
            return optimizer.step(**kwargs) if stepper is None else stepper.step()

    @contextlib.contextmanager
    def updating(self, optimizer: Optimizer) -> Iterator[None]:
        """Around ``optimizer.step()``: release the weights, then drop spent grads and rebuild the weights.

        The weights come back from the masters also when the step raises.
        """
        entries = self.for_optimizer(optimizer)
        released = []
        if self._held:  # remainders: one parameter at a time, the rebuilt master replaces remainder and weight
            for entry in entries:
                self._rebuild([entry])
                if self.free_weights_during_step:
                    released += _release([entry])
        elif self.free_weights_during_step:
            released = _release(entries)
        try:
            yield
        finally:
            if released:  # the step's end holds no more than its middle
                for entry in entries:
                    entry.master.grad = None
                for storage, nbytes in released:
                    storage.resize_(nbytes)
            self._write_back(entries)

    def _rebuild(self, entries: Iterable[MasterEntry]) -> None:
        """Remainders: each master held as weight + remainder becomes FP32 again (the remainder is released)."""
        for entry in entries:
            key = id(entry.master)
            if key in self._held:
                rem = self._rems[key]
                entry.master.untyped_storage().resize_(entry.master.numel() * 4)
                join_into(entry.low.detach(), rem, entry.master.detach())
                rem.untyped_storage().resize_(0)
                self._held.discard(key)

    def _write_back(self, entries: list[MasterEntry]) -> None:
        """The masters into the weights: rounded (FP32 copies), or split into weight + remainder and released."""
        if not self.remainders:
            self.copy_to_params(entries)
            return
        copies = []
        for entry in entries:
            low, master = entry.low, entry.master
            if not (low.is_contiguous() and master.is_contiguous() and master.untyped_storage().resizable()):
                copies.append(entry)  # keeps its FP32 copy
                continue
            rem = self._rems.get(id(master))
            if rem is None:
                rem = self._rems[id(master)] = torch.empty(low.shape, dtype=torch.int16, device=low.device)
            rem.untyped_storage().resize_(rem.numel() * 2)
            self._low_of[id(master)] = low
            with torch.no_grad():
                split_into(master.detach(), low.detach(), rem)
            master.untyped_storage().resize_(0)
            self._held.add(id(master))
        self.copy_to_params(copies)

    def store_fp32(self, module: nn.Module) -> None:
        """Re-store ``module``'s low-precision parameters and buffers in FP32 (parameters from their masters)."""
        with torch.no_grad():
            for param in module.parameters():
                if param.is_floating_point() and param.dtype != torch.float32:
                    entry = self._entries.get(id(param))
                    value = self.value(entry) if entry is not None and entry.low is param else param.detach()
                    param.data = value.to(torch.float32, copy=True)
        buffers_to_fp32(module)

    # --------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Tensor]:
        """``{parameter name: FP32 master}`` (remainders: joined, new tensors)."""
        return {e.name: self.value(e) for e in self._entries.values()}

    def load_state_dict(self, masters: Any) -> None:
        """Restore masters (and round them into the weights); before :meth:`install` they wait for it."""
        if not isinstance(masters, Mapping):
            raise StateDictError(f"the checkpoint's 'masters' must be a dict of tensors, not {type(masters).__name__}")
        if not self._entries:
            self._pending = dict(masters)
            return
        current = {e.name: e for e in self._entries.values()}
        missing, unexpected = sorted(set(current) - set(masters)), sorted(set(masters) - set(current))
        if missing or unexpected:
            raise StateDictError(
                f"the checkpoint's master weights do not match the model: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name, entry in current.items():
                value = masters[name]
                if not isinstance(value, Tensor) or value.shape != entry.master.shape:
                    raise StateDictError(f"master weight {name!r} has shape {getattr(value, 'shape', None)}, "
                                         f"the model's is {tuple(entry.master.shape)}")
                if id(entry.master) in self._held:
                    split_into(value.detach().to(entry.low.device, torch.float32).contiguous(), entry.low,
                               self._rems[id(entry.master)])
                else:
                    entry.master.copy_(value)
                    entry.low.copy_(entry.master)

    def clear_cache(self) -> None:
        """Forget the per-optimizer entry lists (after a fit)."""
        self._by_optimizer.clear()


def _release(entries: Iterable[MasterEntry]) -> list[tuple[Any, int]]:
    """Free the storage of low-precision weights that own it whole; returns ``(storage, nbytes)`` to restore.

    A weight that is a view of a larger buffer, or whose storage cannot be
    resized, is kept.
    """
    released: list[tuple[Any, int]] = []
    for _, low, master in entries:
        if low is master or low.storage_offset() != 0 or not low.is_contiguous():
            continue
        storage = low.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes != low.numel() * low.element_size() or nbytes == 0 or not storage.resizable():
            continue
        storage.resize_(0)
        released.append((storage, nbytes))
    return released
