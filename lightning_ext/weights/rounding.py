"""``bf16-kahan`` and ``bf16-sr`` in torch: the user's optimizer, bf16 weights, no FP32 masters.

The core's rules (:mod:`mp_callbacks.weights`) decide how an update is
written into a bf16 weight; :class:`UpdateRounding` wraps the user's
optimizer (AdamW, SGD with momentum, any first-order torch optimizer) so
that it computes that update in FP32 with FP32 states:

* the optimizer's param groups keep the bf16 parameters and their bf16
  gradients (clipping, hooks and the overflow check see them as they are);
  its state is keyed by them and holds FP32 tensors (``state_dtype``
  ``bfloat16``: bf16 tensors, FP32 only while the parameter is updated);
* :meth:`step` calls ``optimizer.step()`` once (hooks and LR-scheduler
  bookkeeping as usual) with a closure that, before the optimizer's own loop,
  updates each bf16 parameter in turn (:func:`~lightning_ext.weights.rounding_step.update_parameter`):
  an optimizer update of an FP32 value ``t`` (``f32(w) + f32(c)`` under Kahan,
  ``f32(w)`` under SR) with the FP32 gradient and the parameter's state, and the
  core's rule writes ``t`` into the weight (:func:`~mp_callbacks.weights.kahan_apply` /
  :func:`~mp_callbacks.weights.stochastic_round`); elementwise optimizers
  do this in cache-sized chunks through reused buffers, bit for bit the whole
  tensor's result; the spent bf16 gradient is released.  The optimizer's own
  loop then updates what is left: FP32 parameters (kept by the policy), exactly
  as without the plugin (under ``state_dtype="8bit"`` torchao's ``AdamW8bit``
  computes both: :class:`~lightning_ext.weights.low_bit.EightBitAdamW`);
* so a step holds the core estimate (weights, gradients, compensation,
  states: :func:`mp_callbacks.memory.estimate_memory`) plus the chunk
  buffers (two FP32 buffers of at most 2**18 elements, two more for bf16 states;
  a full-size FP32 copy of the parameter for a non-elementwise optimizer);
* stochastic rounding draws from the core's counter-based stream (seed,
  parameter index, update counter, element index): :class:`~lightning_ext.weights.rounding_ops.TorchRoundingOps`
  computes the same bits as the NumPy reference and ``keras.ops``;
* checkpoints: :meth:`state_dict` carries the compensation buffers and the
  stream (plain tensors and ints); optimizer checkpoints keep their FP32
  states (torch's loader would cast them to the bf16 parameters' dtype: a
  load hook puts the saved values back in the state dtype).

A skipped step never calls :meth:`step`: weights, buffers, the counter and
the optimizer state stay bit-for-bit as they were.

:func:`~lightning_ext.weights.weight_store` picks the plugin's one weight store for a recipe: this class or
:class:`~lightning_ext.weights.masters.MasterWeights`, which share their interface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from mp_callbacks.recipes import Recipe
from mp_callbacks.settings import StateDictError
from mp_callbacks.weights import (
    MasterPlan,
    RoundingStream,
    compensated_value,
    initial_compensation,
    make_rounding_state,
    read_rounding_state,
)

from ..policy import buffers_to_fp32, restore_module_storage, torch_dtype
from .rounding_ops import TORCH_ROUNDING_OPS
from .rounding_step import CHUNK, Scratch, update_parameter

__all__ = ["RoundingEntry", "UpdateRounding"]


class RoundingEntry(NamedTuple):
    """One low-precision parameter: its name, its index in the random stream, its compensation (Kahan)."""

    name: str
    param: nn.Parameter
    index: int
    comp: Tensor | None


def _unhooked_step(optimizer: Optimizer) -> Callable[..., Any]:
    """The optimizer class's own ``step`` without torch's hook wrapper (hooks run once, around the whole step)."""
    fn = type(optimizer).step
    while getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


class UpdateRounding:
    """Kahan-compensated or stochastically rounded updates of bf16 weights, around the user's optimizer.

    Args:
      plan: the recipe's :class:`~mp_callbacks.memory.MasterPlan` (``update_rounding``
        ``kahan`` or ``stochastic``, ``state_dtype``).
      seed: the stochastic-rounding seed (any integer >= 0; used mod ``2**32``).
    """

    keeps_masters = False
    """No FP32 copies: the bf16 weights are updated in place (installed under FSDP2 too)."""
    free_weights_during_step = False
    """Nothing to release: the weights are what the step updates."""

    def __init__(self, plan: MasterPlan, seed: int = 0) -> None:
        if not plan.rounds_updates:
            raise ValueError(
                f"UpdateRounding needs update_rounding 'kahan' or 'stochastic', not {plan.update_rounding!r}")
        self.plan = plan
        self.mode = plan.update_rounding
        self.state_dtype = torch_dtype("float32" if plan.quantized_states else plan.state_dtype)
        self.stream = RoundingStream(seed, 0)
        self._entries: dict[int, RoundingEntry] = {}  # id(param) -> entry
        self._pending: dict[str, Tensor] = {}  # compensation by name, waiting for install
        self._originals: dict[str, Tensor] = {}  # FP32 values before the cast, until the first update
        self._hooked: dict[int, Any] = {}  # id(optimizer) -> (optimizer, hook handles)
        self._loading: dict[int, Mapping[str, Any]] = {}
        self._sample: tuple[int | None] | None = None  # (meter samples,) when requested
        self.update_samples: dict[int, Tensor] = {}
        self._scratch = Scratch()  # the chunk buffers every step reuses (lightning_ext.weights.rounding_step)

    @classmethod
    def for_recipe(cls, recipe: Recipe, seed: int = 0) -> UpdateRounding | None:
        """An instance for ``bf16-kahan``/``bf16-sr`` recipes, None for the others."""
        return cls(recipe.master, seed) if recipe.master.rounds_updates else None

    @property
    def kahan(self) -> bool:
        """True under Kahan compensation (else stochastic rounding)."""
        return self.mode == "kahan"

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[RoundingEntry]:
        """Every low-precision parameter, in installation order."""
        return list(self._entries.values())

    def compensation(self) -> dict[str, Tensor]:
        """``{parameter name: compensation buffer}`` (empty under stochastic rounding)."""
        return {e.name: e.comp for e in self._entries.values() if e.comp is not None}

    def buffers(self) -> list[Tensor]:
        """The compensation buffers (what a step holds beyond weights, gradients and optimizer state)."""
        return [e.comp for e in self._entries.values() if e.comp is not None]

    # -------------------------------------------------------------- install
    def record_originals(self, module: nn.Module, originals: Mapping[str, Tensor]) -> None:
        """FP32 values of parameters just cast to bf16: under Kahan their rounding error starts the
        compensation; until the first update they are what :meth:`store_fp32` restores."""
        named = dict(module.named_parameters())
        with torch.no_grad():
            for name, fp32 in originals.items():
                param = named.get(name)
                if param is not None and param.dtype != torch.float32:
                    self._originals[name] = fp32
                    if self.kahan:
                        self._pending[name] = initial_compensation(fp32.to(param.device), param, TORCH_ROUNDING_OPS)

    def restore_originals(self, root: nn.Module) -> None:
        """Undo the storage cast :meth:`record_originals` saw (``root``'s parameters get their FP32 values back)
        and forget it: the model is about to be sharded, whose FP32 shards need no copy."""
        restore_module_storage(root, self._originals)
        self._originals.clear()
        self._pending.clear()

    def install(self, root: nn.Module, optimizers: Iterable[Optimizer]) -> None:
        """Give every low-precision parameter of the optimizers an entry (a compensation buffer under
        Kahan), move existing optimizer state to the state dtype, and hook the optimizers' state loading."""
        names = {id(p): n for n, p in root.named_parameters()}
        entries: dict[int, RoundingEntry] = {}
        index = 0
        for opt in optimizers:
            for p in (p for g in opt.param_groups for p in g["params"]):
                index += 1
                if not p.is_floating_point() or p.dtype == torch.float32 or id(p) in entries:
                    continue
                old = self._entries.get(id(p))
                name = names.get(id(p), old.name if old is not None else f"<unnamed {index - 1}>")
                comp = None
                if self.kahan:
                    comp = self._pending.pop(name, None)
                    if comp is None:
                        comp = old.comp if old is not None and old.param is p else torch.zeros_like(p)
                    comp = comp.detach().to(device=p.device, dtype=p.dtype).clone()
                entries[id(p)] = RoundingEntry(name, p, index - 1, comp)
                if p in opt.state:
                    opt.state[p] = self._cast_state(opt.state[p], self.state_dtype)
            self._hook_loading(opt)
        self._entries = entries
        dist = torch.distributed
        if self.kahan and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():  # DDP broadcasts rank 0's weights: the compensation follows rank 0 too
                for entry in entries.values():
                    dist.broadcast(entry.comp, src=0)

    def _hook_loading(self, opt: Optimizer) -> None:
        if id(opt) in self._hooked and self._hooked[id(opt)][0] is opt:
            return

        def pre(optimizer: Optimizer, state_dict: Mapping[str, Any]) -> None:
            self._loading[id(optimizer)] = state_dict

        def post(optimizer: Optimizer) -> None:
            saved = self._loading.pop(id(optimizer), None)
            if saved is not None:
                self._restore_state_dtype(optimizer, saved)

        self._hooked[id(opt)] = (opt, opt.register_load_state_dict_pre_hook(pre),
                                 opt.register_load_state_dict_post_hook(post))

    def _restore_state_dtype(self, opt: Optimizer, saved: Mapping[str, Any]) -> None:
        """torch casts loaded floating state to the parameter's dtype (bf16): put the saved values back
        in the state dtype (bit-exact FP32 states across a resume)."""
        ids = chain.from_iterable(g["params"] for g in saved["param_groups"])
        params = chain.from_iterable(g["params"] for g in opt.param_groups)
        for key, p in zip(ids, params):
            if id(p) in self._entries and key in saved["state"] and p in opt.state:
                restored = self._cast_state(saved["state"][key], self.state_dtype, device=p.device)
                opt.state[p].update(restored)

    @staticmethod
    def _cast_state(state: Mapping[str, Any], dtype: torch.dtype, device: Any = None) -> dict[str, Any]:
        return {k: (v.to(device=device if device is not None else v.device, dtype=dtype)
                    if type(v) is Tensor and v.is_floating_point() and v.dim() else v)  # subclasses: as they are
                for k, v in state.items()}

    # ----------------------------------------------------------------- step
    def request_update_samples(self, samples: int | None) -> None:
        """Keep, for the next applied step, each rounded parameter's FP32 update (``t_new - t``) on the
        elements :func:`~lightning_ext.diagnostics.meters.sample` reads: the swamping meter's input."""
        self._sample = (samples,)
        self.update_samples = {}

    def collect_grads(self, optimizer: Optimizer) -> None:
        """Nothing to move: the step reads the bf16 gradients where they are."""

    def clear_cache(self) -> None:
        """Release the step's chunk buffers (reallocated at the next step)."""
        self._scratch.clear()

    def step(self, optimizer: Optimizer, stepper: Any = None, **kwargs: Any) -> Any:
        """``optimizer.step()`` with the bf16 parameters updated by the recipe's rule (see the module docstring).

        ``stepper``: an :class:`~lightning_ext.weights.low_bit.EightBitAdamW` of ``optimizer`` (``state_dtype="8bit"``):
        its 8-bit optimizer computes the updates, of the FP32 parameters too.
        """
        if "closure" in kwargs:
            raise RuntimeError("bf16-kahan/bf16-sr step the optimizer after the backward: a closure is not supported")
        ran: list[bool] = []

        def update_rounded() -> None:
            if not ran:
                ran.append(True)
                self._update(optimizer if stepper is None else stepper.inner)
                if stepper is not None:  # the FP32 parameters left: the 8-bit update too
                    stepper.update()

        return optimizer.step(closure=update_rounded, **kwargs)

    def _update(self, opt: Optimizer) -> None:
        inner = _unhooked_step(opt)
        groups = opt.param_groups
        saved = [g["params"] for g in groups]
        sample_request, self._sample = self._sample, None
        self._originals.clear()
        try:
            for g in groups:
                g["params"] = []
            for group, params in zip(groups, saved):
                for p in params:
                    entry = self._entries.get(id(p))
                    if entry is not None and p.grad is not None and entry.param is p:
                        self._update_one(opt, inner, group, entry, sample_request)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
        self.stream = self.stream.advance()

    def _update_one(self, opt: Optimizer, inner: Callable[..., Any], group: dict, entry: RoundingEntry,
                    sample_request: tuple[int | None] | None) -> None:
        key = None if self.kahan else self.stream.key(entry.index)
        with torch.no_grad():
            update = update_parameter(opt, inner, group, entry.param, entry.comp, key, self.state_dtype,
                                      self._scratch, CHUNK, sample_request)
        if update is not None:
            self.update_samples[id(entry.param)] = update

    # ------------------------------------------------------ runtime FP32 moves
    def store_fp32(self, module: nn.Module, optimizers: Iterable[Optimizer] = ()) -> None:
        """Re-store ``module``'s rounded parameters in FP32 (their FP32 value before the cast while no update
        ran, else ``w + c`` under Kahan, ``w`` under SR) with FP32 optimizer state; they leave the rounding
        (the optimizer updates them directly from now on)."""
        opts = list(optimizers) or [o for o, *_ in self._hooked.values()]
        with torch.no_grad():
            for p in module.parameters():
                entry = self._entries.pop(id(p), None)
                if entry is None:
                    continue
                value = self._originals.pop(entry.name, None)
                if value is None:
                    value = (compensated_value(p, entry.comp, TORCH_ROUNDING_OPS) if entry.comp is not None
                             else p.float())
                p.data = value.detach().to(device=p.device, dtype=torch.float32).clone()
                for opt in opts:
                    if p in opt.state:
                        opt.state[p] = self._cast_state(opt.state[p], torch.float32)
        buffers_to_fp32(module)

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the core record (mode, storage, seed, counter) + ``compensation`` ``{name: tensor}``."""
        state = make_rounding_state(self.mode, self.stream, self.plan.param_dtype)
        state["compensation"] = {name: c.detach().clone() for name, c in self.compensation().items()}
        return state

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict` (before :meth:`install` the buffers wait for it)."""
        stream = read_rounding_state(self.mode, state)
        comps = state.get("compensation") or {}
        if not isinstance(comps, Mapping):
            raise StateDictError(f"the checkpoint's compensation buffers must be a dict, not {type(comps).__name__}")
        if self.kahan and self._entries:
            current = self.compensation()
            missing, unexpected = sorted(set(current) - set(comps)), sorted(set(comps) - set(current))
            if missing or unexpected:
                raise StateDictError(f"the checkpoint's compensation buffers do not match the model: missing "
                                     f"{missing}, unexpected {unexpected}")
            for name, buf in current.items():
                value = comps[name]
                if not isinstance(value, Tensor) or value.shape != buf.shape:
                    raise StateDictError(f"compensation buffer {name!r} has shape {getattr(value, 'shape', None)}, "
                                         f"the parameter's is {tuple(buf.shape)}")
            with torch.no_grad():
                for name, buf in current.items():
                    buf.copy_(comps[name])
        elif self.kahan:
            self._pending = {k: v for k, v in comps.items()}
        self.stream = stream
