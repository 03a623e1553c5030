"""``fp8-mixed`` in torch: FP8 matmuls with per-tensor scaling, the states stepped on the device.

:class:`TorchFP8` is what :class:`lightning_ext.MixedPrecision` holds under
``fp8-mixed`` (``plugin.fp8``).  It

* replaces the ``forward`` of every ``nn.Linear`` the policy runs in low
  precision (not inside an FP32 region) and of every ``nn.MultiheadAttention``
  (its in/out projections, :mod:`lightning_ext.fp8.attention`) by an FP8
  matmul (:class:`_FP8Matmul`): inputs and weights quantize-dequantize to
  e4m3 with their own scales, the output gradient to e5m2 in the backward,
  as :mod:`mp_callbacks.fp8.recipe` describes (the matmul of the dequantized
  values in float32, the output in the autocast dtype; :mod:`lightning_ext.fp8.matmul`);
* keeps, for the three tensors of every FP8 matmul, the core's
  :class:`~mp_callbacks.fp8.FP8State` as batched device tensors (one batch per
  tensor role), records each tensor's amax during the step (a running max,
  no host read) and steps the states with the core's
  :func:`~mp_callbacks.fp8.next_fp8_state` evaluated with
  :class:`~lightning_ext.ops.TorchOps` after the optimizer step:
  3 batched transitions per step, no host synchronisation;
* folds "an amax was not finite" into the step's ``found_inf`` before the
  plugin's skip decision (:meth:`before_step`), so such a step is skipped
  like any overflow; a skipped step keeps every FP8 state as it was
  (:meth:`after_step`), so nothing non-finite enters a history.

Delayed scaling (default) quantizes with the scale of the last committed
state; current scaling steps a copy of the tensor's state with this call's
amax first and quantizes with that scale.  Under DDP the recorded amaxes are
all-reduced (MAX) before the decision, so every rank takes the same scales.

On a CUDA device with FP8 tensor cores (compute capability >= 8.9) the
forward matmul runs as ``torch._scaled_mm`` when the shapes allow it (both
dimensions multiples of 16); this path is gated and untested here (no such
device in CI); everywhere else the emulation above runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from mp_callbacks.diagnostics import fp8_metrics
from mp_callbacks.fp8 import FP8_ROLES, FP8Recipe, FP8State, fp8_state_from_dict, fp8_state_to_dict, next_fp8_state
from mp_callbacks.policy import PrecisionPolicy
from mp_callbacks.settings import StateDictError

from ..ops import TorchOps
from ..policy import fp32_compute_modules
from .allgather import link_weight
from .attention import mha_forward, mha_matmuls
from .blocks import block_cast
from .matmul import fp8_linear

__all__ = ["TorchFP8", "fp8_modules"]

FP8_SCHEMA_VERSION = 1
"""Version of :meth:`TorchFP8.state_dict`'s record."""


def fp8_modules(root: nn.Module, policy: PrecisionPolicy) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` of every ``nn.Linear`` / ``nn.MultiheadAttention`` of ``root`` that runs as
    FP8 matmuls: the policy computes it in low precision and no FP32 region contains it (Linear
    layers owned by a MultiheadAttention are its projections, handled with it)."""
    regions = [p for p, _ in fp32_compute_modules(root, policy)]

    def in_region(path: str) -> bool:
        return any(r == "" or path == r or path.startswith(r + ".") for r in regions)

    owned: set[int] = set()
    for path, module in root.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            owned.update(id(m) for m in module.modules() if m is not module)
        if id(module) in owned or in_region(path) or policy.keeps_fp32(module, path):
            continue
        if isinstance(module, (nn.Linear, nn.MultiheadAttention)):
            yield path, module


class TorchFP8:
    """The FP8 matmuls of one model and their per-tensor scaling states (see the module docstring).

    Args:
      recipe: the :class:`~mp_callbacks.fp8.FP8Recipe` (``plugin.recipe.fp8``).
    """

    def __init__(self, recipe: FP8Recipe) -> None:
        self.recipe = recipe
        self.granularity = recipe.granularity
        self.configs = recipe.configs
        self.names: list[str] = []
        self._index: dict[str, int] = {}
        self.states: dict[str, FP8State] | None = None
        self._ops: TorchOps | None = None
        self._amax: dict[str, list[Tensor | None]] = {r: [] for r in FP8_ROLES}
        self._counts: dict[str, list[Tensor | None]] = {r: [] for r in FP8_ROLES}
        self._wrapped: list[tuple[nn.Module, Any, str]] = []
        self._step: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        self._fp8_dtypes = {r: getattr(torch, c.format) for r, c in self.configs.items()}
        self._max = {r: c.fmt.max for r, c in self.configs.items()}
        self.measure = False
        self.latest: dict[str, Any] = {}

    @classmethod
    def for_recipe(cls, recipe: Any) -> TorchFP8 | None:
        """A :class:`TorchFP8` for a recipe with FP8 settings (``fp8-mixed``), else None."""
        return cls(recipe.fp8) if getattr(recipe, "fp8", None) is not None else None

    def __repr__(self) -> str:
        return f"TorchFP8(preset={self.recipe.preset!r}, mode={self.recipe.mode!r}, matmuls={len(self.names)})"

    # ------------------------------------------------------------ modules
    def install(self, root: nn.Module, policy: PrecisionPolicy) -> list[str]:
        """Make every FP8-eligible module of ``root`` (:func:`fp8_modules`) run FP8 matmuls.

        Returns the matmul names (``path`` for a Linear; ``path.in_proj`` / ``.q_proj`` / ``.k_proj``
        / ``.v_proj`` / ``.out_proj`` for attention).  A second call with the same tree changes nothing.
        """
        done = {id(m) for m, _, _ in self._wrapped}
        unlinked: list[str] = []
        for path, module in fp8_modules(root, policy):
            if id(module) in done:
                continue
            if isinstance(module, nn.MultiheadAttention):
                indices = {part: self._add(f"{path}.{part}" if path else part) for part in mha_matmuls(module)}
                forward = functools.partial(mha_forward, module, self._matmul_by_name(indices), module.forward)
            else:
                index = self._add(path)
                forward = functools.partial(self._linear_forward, module, index)
                if not link_weight(module, self, index) and self.recipe.fsdp_float8_all_gather:
                    unlinked.append(path or "the model")
            self._wrapped.append((module, module.__dict__.get("forward"), path))
            module.forward = functools.wraps(type(module).forward)(forward)  # type: ignore[method-assign]
        if unlinked:
            raise MisconfigurationException(
                f"fp8={{'fsdp_float8_all_gather': True}} all-gathers FP8 Linear weights under FSDP2, but "
                f"{', '.join(unlinked[:4])}{' ...' if len(unlinked) > 4 else ''} is not an FSDP2-sharded FP8 weight. "
                "Use ModelParallelStrategy and shard with lightning_ext.distributed.fully_shard_model(model, "
                "plugin.recipe, mesh), or call lightning_ext.distributed.prepare_fp8_all_gather(model, plugin.recipe) "
                "before fully_shard; without FSDP2 drop the setting")
        return list(self.names)

    def _add(self, name: str) -> int:
        if name in self._index:  # installed again (a new fit): same state
            return self._index[name]
        if self.states is not None:
            self._grow(1)
        self.names.append(name)
        self._index[name] = len(self.names) - 1
        for role in FP8_ROLES:
            self._amax[role].append(None)
            self._counts[role].append(None)
        return len(self.names) - 1

    def _linear_forward(self, module: nn.Linear, index: int, input: Tensor) -> Tensor:
        return fp8_linear(input, module.weight, module.bias, self, index)

    def _matmul_by_name(self, indices: Mapping[str, int]) -> Callable[..., Tensor]:
        def matmul(part: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            return fp8_linear(x, weight, bias, self, indices[part])
        return matmul

    def remove(self, path: str | None = None) -> None:
        """Restore the own ``forward`` of every wrapped module (or of those at/under ``path``);
        their states stay (unused)."""
        keep = []
        for module, previous, p in reversed(self._wrapped):
            if path is not None and not (p == path or p.startswith(path + ".") or path == ""):
                keep.append((module, previous, p))
                continue
            if path is not None and isinstance(module, nn.Linear):  # an FP32 region: not gathered in FP8 (teardown
                link_weight(module, None, -1)  # keeps the tie: FSDP2's FP8 buffer stays, later gathers need a scale)
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous  # type: ignore[method-assign]
        self._wrapped = list(reversed(keep))

    # ------------------------------------------------------------- states
    def _ensure(self, device: torch.device) -> TorchOps:
        if self._ops is None or self._ops.device != device:
            self._ops = TorchOps(device)
            if self.states is None:
                self.states = {r: self._initial(c, len(self.names), self._ops) for r, c in self.configs.items()}
            else:
                self.states = {r: FP8State(*(t.to(device) for t in s)) for r, s in self.states.items()}
        return self._ops

    @staticmethod
    def _initial(config: Any, n: int, ops: TorchOps) -> FP8State:
        dev = ops.device
        return FP8State(torch.zeros(n, config.history_len, device=dev), torch.ones(n, device=dev),
                        torch.ones(n, device=dev), torch.zeros(n, dtype=torch.int32, device=dev),
                        torch.zeros(n, dtype=torch.int32, device=dev))

    def _grow(self, extra: int) -> None:
        assert self.states is not None and self._ops is not None
        more = {r: self._initial(c, extra, self._ops) for r, c in self.configs.items()}
        self.states = {r: FP8State(*(torch.cat([a, b]) for a, b in zip(self.states[r], more[r])))
                       for r in self.states}

    def state_of(self, role: str, index: int) -> FP8State:
        """One tensor's committed state (0-d / 1-d views of the batched device tensors)."""
        assert self.states is not None
        return FP8State(*(t[index] for t in self.states[role]))

    @property
    def nbytes(self) -> int:
        """Bytes held by the scaling states (0 before the first step)."""
        return sum(t.nbytes for s in (self.states or {}).values() for t in s)

    # -------------------------------------------------------------- a call
    def quantize(self, role: str, index: int, x: Tensor, record: bool = True,
                 axis: int = -1, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(q, scale_inv)``: ``x`` cast to the role's FP8 dtype with its scale (saturating), and the
        float32 factor that dequantizes it (broadcastable to ``x``).  ``record``: keep the amax for this
        step's transition.  ``axis``: the matmul's contraction axis (rowwise, blockwise and MX scales).
        ``amax``: the tensor's amax when ``x`` is a shard of it (FP8 all-gather); default ``x``'s."""
        ops = self._ensure(x.device)
        config = self.configs[role]
        if amax is None:
            amax = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        if self.granularity.kind != "tensorwise":
            return self._quantize_blocks(role, index, x, amax, record, axis)
        state = self.state_of(role, index)
        if config.mode == "current":
            state, _ = next_fp8_state(config, state, amax, ops)
        x32 = x.detach().float() if x.requires_grad else x.float()
        y = x32 / state.scale_inv if config.stored == "scale_inv" else x32 * state.scale
        fmax = self._max[role]
        q = y.clamp(-fmax, fmax).to(self._fp8_dtypes[role])
        if record:
            self._record(role, index, amax)
            if self.measure:
                counts = torch.stack([(y.abs() > fmax).sum(), ((x32 != 0) & (q.float() == 0)).sum(),
                                      torch.tensor(x.numel(), device=x.device)]).float()
                prev = self._counts[role][index]
                self._counts[role][index] = counts if prev is None else prev + counts
        return q, state.scale_inv.reshape(())

    def _quantize_blocks(self, role: str, index: int, x: Tensor, amax: Tensor, record: bool,
                         axis: int) -> tuple[Tensor, Tensor]:
        """A finer granularity's cast (:mod:`lightning_ext.fp8.blocks`): current scales per row or block.
        The tensor's amax is still recorded, so a non-finite block skips the step as per-tensor does."""
        q, inv, _ = block_cast(x, self.granularity, self._fp8_dtypes[role], axis=axis, weight=role == "weights")
        if record:
            self._record(role, index, amax)
            if self.measure:
                x32 = x.detach().float()
                with torch.no_grad():
                    scaled = x32 / inv
                counts = torch.stack([(scaled.abs() > self._max[role]).sum(), ((x32 != 0) & (q.float() == 0)).sum(),
                                      torch.tensor(x.numel(), device=x.device)]).float()
                prev = self._counts[role][index]
                self._counts[role][index] = counts if prev is None else prev + counts
        return q, inv

    def _record(self, role: str, index: int, amax: Tensor) -> None:
        prev = self._amax[role][index]
        self._amax[role][index] = amax if prev is None else torch.maximum(prev, amax)  # NaN propagates

    # -------------------------------------------------------------- a step
    def recorded(self) -> bool:
        """True when this step recorded an amax (a training forward ran)."""
        return any(a is not None for r in FP8_ROLES for a in self._amax[r])

    def before_step(self, found_inf: Tensor | None) -> Tensor | None:
        """Gather this step's amaxes (all-reduced MAX over DDP ranks; NaN counts as inf) and OR
        "not all finite" into ``found_inf`` in place (before the plugin reads it).  Returns the flag."""
        if not self.recorded() or self.states is None:
            self._step = None
            return None
        device = self.states["inputs"].scale.device
        amax, used = {}, {}
        for role in FP8_ROLES:
            zero = torch.zeros((), device=device)
            amax[role] = torch.stack([zero if a is None else a.to(device) for a in self._amax[role]])
            used[role] = torch.tensor([a is not None for a in self._amax[role]], device=device)
        flat = torch.cat([amax[r] for r in FP8_ROLES])
        flat = torch.where(torch.isnan(flat), torch.full_like(flat, float("inf")), flat)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            mask = torch.cat([used[r] for r in FP8_ROLES]).float()
            both = torch.cat([flat, mask])
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            flat, mask = both[: flat.numel()], both[flat.numel():] > 0
            n = len(self.names)
            used = {r: mask[i * n:(i + 1) * n] for i, r in enumerate(FP8_ROLES)}
        n = len(self.names)
        amax = {r: flat[i * n:(i + 1) * n] for i, r in enumerate(FP8_ROLES)}
        bad = torch.logical_not(torch.isfinite(torch.cat([torch.where(used[r], amax[r], 0.0) for r in FP8_ROLES])))
        flag = bad.any()
        if found_inf is not None:
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.dtype)))
        self._step = (amax, used)
        return flag

    def after_step(self, applied: bool) -> None:
        """Step every recorded tensor's state with its amax (the core transition, batched per role);
        keep the old state where the step was not applied or the matmul did not run."""
        if self._step is None:
            self.discard_step()
            return
        amax, used = self._step
        ops = self._ensure(amax["inputs"].device)
        assert self.states is not None
        latest: dict[str, Any] = {"names": list(self.names), "amax": amax, "used": used, "applied": applied}
        for role in FP8_ROLES:
            old = self.states[role]
            new, _ = next_fp8_state(self.configs[role], old, amax[role], ops)
            cond = used[role] if applied else torch.zeros_like(used[role])
            self.states[role] = FP8State(*(ops.where(cond, n, o) for n, o in zip(new, old)))
        latest["scale"] = {r: self.states[r].scale for r in FP8_ROLES}
        latest["scale_inv"] = {r: self.states[r].scale_inv for r in FP8_ROLES}
        if any(c is not None for r in FP8_ROLES for c in self._counts[r]):
            zero = torch.zeros(3, device=amax["inputs"].device)
            latest["counts"] = {r: torch.stack([zero if c is None else c for c in self._counts[r]])
                                for r in FP8_ROLES}
        self.latest = latest
        self.measure = False  # the monitor asks again for its next logging step
        self.discard_step()

    def host_metrics(self) -> dict[str, float] | None:
        """The latest step's ``mp/fp8_*`` metrics (:func:`mp_callbacks.diagnostics.fp8_metrics`): one host
        read (the monitor's logging steps); None before the first step."""
        latest = self.latest
        if not latest or "scale" not in latest:
            return None
        n = len(latest["names"])
        counts = latest.get("counts")
        parts = [latest["amax"][r] for r in FP8_ROLES] + [latest["scale"][r] for r in FP8_ROLES]
        if counts is not None:
            parts += [counts[r] for r in FP8_ROLES]
        flat = torch.cat([p.detach().float().reshape(-1) for p in parts]).tolist()
        amax = {r: flat[i * n:(i + 1) * n] for i, r in enumerate(FP8_ROLES)}
        scale = {r: flat[(3 + i) * n:(4 + i) * n] for i, r in enumerate(FP8_ROLES)}
        by_role = None
        if counts is not None:
            rest = flat[6 * n:]
            by_role = {r: [rest[(i * n + j) * 3:(i * n + j) * 3 + 3] for j in range(n)]
                       for i, r in enumerate(FP8_ROLES)}
        return fp8_metrics(latest["names"], FP8_ROLES, amax, scale, by_role)

    def discard_step(self) -> None:
        """Forget this step's records (no backward ran, or after :meth:`after_step`)."""
        for role in FP8_ROLES:
            self._amax[role] = [None] * len(self.names)
            self._counts[role] = [None] * len(self.names)
        self._step = None

    # --------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the recipe's settings, the matmul names and every tensor's state (one host read)."""
        states = {}
        if self.states is not None:
            for role in FP8_ROLES:
                states[role] = [fp8_state_to_dict(FP8State(*(t[i].cpu() for t in self.states[role])))
                                for i in range(len(self.names))]
        return {"schema_version": FP8_SCHEMA_VERSION, "fp8": self.recipe.to_dict(), "names": list(self.names),
                "states": states}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; other settings or other matmuls are a ``StateDictError``."""
        if not isinstance(data, Mapping) or data.get("schema_version") != FP8_SCHEMA_VERSION:
            raise StateDictError(f"FP8 state: expected schema_version {FP8_SCHEMA_VERSION}, got "
                                 f"{data.get('schema_version') if isinstance(data, Mapping) else data!r}")
        if FP8Recipe.from_dict(data["fp8"]) != self.recipe:
            raise StateDictError(f"the checkpoint's FP8 settings {data['fp8']} differ from this run's "
                                 f"{self.recipe.to_dict()}")
        if list(data["names"]) != self.names:
            raise StateDictError(f"the checkpoint has FP8 matmuls {list(data['names'])}; this model has {self.names}")
        if not data["states"]:
            return
        device = self.states["inputs"].scale.device if self.states is not None else torch.device("cpu")
        ops = self._ensure(device)
        restored = {}
        for role in FP8_ROLES:
            rows = [fp8_state_from_dict(self.configs[role], d) for d in data["states"][role]]
            restored[role] = FP8State(*(torch.stack([torch.from_numpy(getattr(r, f).copy()) for r in rows])
                                        .to(ops.device) for f in FP8State._fields))
        self.states = restored
