"""One rounded parameter's update in cache-sized chunks: the step of ``bf16-kahan`` and ``bf16-sr`` in torch.

The rule (what :class:`~lightning_ext.weights.rounding.UpdateRounding` computes): an optimizer update of an FP32
value ``t`` of the bf16 weight (``f32(w) + f32(c)`` under Kahan, ``f32(w)`` under SR) from the FP32 gradient
and FP32 state; the core's rule writes the result back (:func:`~mp_callbacks.weights.kahan_apply`,
:func:`~mp_callbacks.weights.stochastic_round`).  The update is the user's optimizer's own (its class's
``step`` on ``t``, as configured), except for exact ``Adam``/``AdamW`` with FP32 states whose implementation
is left to torch (or ``fused=True``) on a device with torch's fused Adam kernel (:data:`FUSED_DEVICES`): there
it is that kernel, called directly with the group's hyperparameters from the first update on (the state made
in its form: ``step`` a float32 tensor on the device, zero moments), which is ``Adam(fused=True)``'s update.

How: an optimizer whose update is elementwise (:data:`ELEMENTWISE`) runs on :data:`CHUNK` elements at a time:
``t`` and the FP32 gradient of a chunk live in :class:`Scratch` buffers reused every step, the chunk's state is
a view of the parameter's FP32 state (``state_dtype`` ``bfloat16``: an FP32 scratch copy, written back rounded
to nearest), and the rule writes the chunk back, operation by operation as the core states it, into
reused buffers.  No step allocates a full-size tensor; the
results are the whole tensor's bit for bit (chunks are multiples of 64 elements, so a vectorized kernel's tail
falls where it falls on the whole tensor).  Other optimizers (and non-contiguous weights) get a full-size FP32
copy of the parameter, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mp_callbacks.diagnostics import sample_stride
from mp_callbacks.weights import BF16_NAN_BITS, MIX_MUL1, MIX_MUL2, kahan_apply, s32, stochastic_round

from .rounding_ops import TORCH_ROUNDING_OPS

CHUNK = 1 << 18
"""Elements updated at a time (a multiple of 64): the chunk's FP32 buffers stay about 1 MB each."""

ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)
"""torch optimizers whose update of an element reads only that element (and scalars): they run chunk by chunk.
A subclass that makes the update non-elementwise sets ``elementwise_update = False``."""

FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu")
"""Device types with torch's fused Adam/AdamW kernel (``torch._fused_adam_``, ``torch._fused_adamw_``)."""


def is_elementwise(optimizer: Optimizer) -> bool:
    """True when ``optimizer`` may update a parameter chunk by chunk (:data:`ELEMENTWISE`)."""
    return isinstance(optimizer, ELEMENTWISE) and getattr(optimizer, "elementwise_update", True)


class Scratch:
    """Reused buffers by name: each grows to the largest size asked for (at most :data:`CHUNK` elements)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        self._aranges: dict[torch.device, Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat buffer of ``n`` elements (its contents are whatever the last user left)."""
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(-(-n // 64) * 64, dtype=dtype, device=device)
        return buf[:n]

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()
        self._aranges.clear()

    def arange(self, n: int, device: torch.device) -> Tensor:
        """int32 ``0 .. n-1`` (kept)."""
        buf = self._aranges.get(device)
        if buf is None or buf.numel() < n:
            buf = self._aranges[device] = torch.arange(-(-n // 64) * 64, dtype=torch.int32, device=device)
        return buf[:n]

    def nbytes(self) -> int:
        """Bytes held."""
        bufs = [*self._buffers.values(), *self._aranges.values()]
        return sum(b.untyped_storage().nbytes() for b in bufs)


def _slices(n: int, chunk: int) -> list[tuple[int, int]]:
    chunk = max(64, chunk // 64 * 64)
    return [(a, min(n, a + chunk)) for a in range(0, n, chunk)]


def update_parameter(opt: Optimizer, inner: Callable[..., Any], group: dict, p: Tensor, comp: Tensor | None,
                     key: int | None, state_dtype: torch.dtype, scratch: Scratch, chunk: int = CHUNK,
                     samples: tuple[int | None] | None = None) -> Tensor | None:
    """Update bf16 ``p`` (compensation ``comp`` under Kahan, SR key ``key`` otherwise) with the optimizer's
    unhooked step ``inner`` on FP32 values, and write it back by the core's rule (see the module docstring).

    ``group`` is ``p``'s param group, emptied by the caller.  Returns the FP32 update ``t_new - t`` on
    :func:`~lightning_ext.diagnostics.meters.sample`'s elements when ``samples`` is given (the swamping meter's input).
    """
    n, grad, state = p.numel(), p.grad, opt.state
    whole = not (p.is_contiguous() and grad.is_contiguous() and (comp is None or comp.is_contiguous())) or (
        n > chunk and not is_elementwise(opt))
    slices = [(0, n)] if whole else _slices(n, chunk)
    full = state.get(p)  # None before the parameter's first update: every chunk starts from no state
    kernel = not whole and _direct_adam(opt, group, full, state_dtype, p.device)
    if kernel and full is None:  # the fused kernel's state, made as torch's fused path makes it
        full = state[p] = _adam_state(group, p)
    first = full is None
    scalars = {} if full is None else {k: v for k, v in full.items() if not (isinstance(v, Tensor) and v.dim())}
    pf, gf = p.detach().view(-1) if not whole else p.detach(), grad.view(-1) if not whole else grad
    cf = None if comp is None else (comp.view(-1) if not whole else comp)
    diffs, before = [], None
    for a, b in slices:
        m, shape = b - a, p.shape if len(slices) == 1 else (b - a,)
        if whole:
            t = pf.to(torch.float32) if cf is None else pf.to(torch.float32).add_(cf.to(torch.float32))
            t.grad = gf.to(torch.float32)
        else:  # no mixed-dtype op (torch's CPU kernels would cast through a hidden FP32 temporary)
            t = scratch.get("t", m, torch.float32, p.device).view(shape)
            t.copy_(pf[a:b].view(shape))
            if cf is not None:  # t0 = f32(c), then the compensated value before the update: u = t_new - t0
                t0 = scratch.get("t0", m, torch.float32, p.device)
                t.add_(t0.copy_(cf[a:b]).view(shape))
                t0.copy_(t.view(-1))
            t.grad = scratch.get("g", m, torch.float32, p.device).view(shape)
            t.grad.copy_(gf[a:b].view(shape))
        if samples is not None:
            before = _sample_part(t, a, n, samples[0]).clone()
        if kernel:  # torch's fused kernel on views of the FP32 state: no optimizer bookkeeping
            views = {k: v if k == "step" else v.view(-1)[a:b].view(shape) for k, v in full.items()}
            views["step"] = scalars["step"].clone()
            _fused_adam_kernel(group, t, views)
            full["step"] = views["step"]
        else:
            _chunk_state(state, t, None if first else full, scalars, a, b, n, whole, scratch)
            group["params"] = [t]
            try:
                inner(opt)
            finally:
                group["params"] = []
                done = state.pop(t, {})
            full = _merge(state, p, full, done, a, b, n, whole, state_dtype)
        t.grad = None
        if samples is not None:
            diffs.append(_sample_part(t, a, n, samples[0]) - before)
        if whole:
            _write_back(pf, cf, t, key)
        elif cf is not None:
            _kahan_chunk(pf[a:b], cf[a:b], t.view(-1), scratch)
        else:
            _sr_chunk(pf[a:b], t.view(-1), key, a, scratch)
    p.grad = None  # spent
    if samples is None:
        return None
    return torch.cat(diffs)


def _direct_adam(opt: Optimizer, group: dict, full: dict | None, state_dtype: torch.dtype,
                 device: torch.device) -> bool:
    """True when the update of ``group``'s parameter is torch's fused Adam/AdamW kernel called directly
    (:func:`_fused_adam_kernel`): exact ``Adam``/``AdamW``, the implementation left to torch (or ``fused=True``),
    not differentiable or capturable, FP32 states on a device of :data:`FUSED_DEVICES`, and the state (``full``)
    either not made yet or in the kernel's form."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or group.get("foreach"):
        return False
    if group.get("fused") is False or group.get("differentiable") or group.get("capturable"):
        return False
    if state_dtype != torch.float32 or device.type not in FUSED_DEVICES:
        return False
    if full is None:
        return True
    keys = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
    step = full.get("step")
    if list(full) != keys or not isinstance(step, Tensor) or step.dtype != torch.float32:
        return False
    return all(type(full[k]) is Tensor and full[k].dtype == torch.float32 and full[k].device == device
               for k in keys[1:])


def _adam_state(group: dict, p: Tensor) -> dict[str, Tensor]:
    """A new Adam/AdamW state for ``p`` in the fused kernel's form: step 0 (float32, on the device), FP32 zeros."""
    state = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
    for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ()):
        state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return state


def _scalar(value: Any) -> float:
    """A hyperparameter as a Python number (a 0-d tensor read once)."""
    return value.item() if isinstance(value, Tensor) else value


def _fused_adam_kernel(group: dict, t: Tensor, st: dict) -> None:
    """One Adam/AdamW update of ``t`` with state ``st``: what torch's fused Adam path does for one tensor: count
    the step, then ``torch._fused_adam(w)_`` with the group's hyperparameters."""
    step = st["step"]
    step.add_(1)
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    amsgrad = bool(group.get("amsgrad"))
    kernel([t], [t.grad], [st["exp_avg"]], [st["exp_avg_sq"]], [st["max_exp_avg_sq"]] if amsgrad else [], [step],
           amsgrad=amsgrad, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
           eps=group["eps"], maximize=bool(group.get("maximize")), grad_scale=None, found_inf=None)


def _plain(v: Tensor) -> bool:
    """False for tensor subclasses (torchao's quantized optimizer states): handed over as they are."""
    return type(v) in (Tensor, torch.nn.Parameter)


def _sample_part(t: Tensor, a: int, n: int, samples: int | None) -> Tensor:
    """The elements of ``t`` (global flat offset ``a`` of ``n``) that :func:`sample` reads from the whole tensor."""
    stride = sample_stride(n, samples)
    flat = t.detach().reshape(-1)
    return flat[(-a) % stride::stride]


def _chunk_state(state: Any, t: Tensor, full: dict | None, scalars: dict, a: int, b: int, n: int, whole: bool,
                 scratch: Scratch) -> None:
    """Give ``t`` its state: slices of the parameter's (FP32 scratch copies of the non-FP32 ones)."""
    if full is None:
        return
    chunk_state = {}
    for k, v in full.items():
        if not (isinstance(v, Tensor) and v.dim()):
            v = scalars[k]
            chunk_state[k] = v.clone() if isinstance(v, Tensor) else v
        elif not _plain(v) or v.numel() != n or not v.is_floating_point():  # whole, as the optimizer made it
            chunk_state[k] = v.to(torch.float32) if _plain(v) and v.is_floating_point() else v
        else:
            part = (v if whole else v.view(-1)[a:b]).view(t.shape)
            if part.dtype != torch.float32:
                buf = scratch.get(f"state:{k}", b - a, torch.float32, t.device).view(t.shape)
                part = buf.copy_(part)
            chunk_state[k] = part
    state[t] = chunk_state


def _merge(state: Any, p: Tensor, full: dict | None, done: dict, a: int, b: int, n: int, whole: bool,
           state_dtype: torch.dtype) -> dict:
    """Fold the chunk's state into the parameter's, in the state dtype (allocated at its first update)."""
    out = {} if full is None else full
    for k, v in done.items():
        if not (isinstance(v, Tensor) and v.dim()):
            out[k] = v  # step counts: every chunk ends at the same value
        elif not _plain(v) or v.numel() != b - a or not v.is_floating_point():  # not elementwise state: whole
            out[k] = v.to(state_dtype) if _plain(v) and v.is_floating_point() else v
        elif not isinstance(out.get(k), Tensor) and b - a == n and v.dtype == state_dtype:
            out[k] = v.view(p.shape)  # created by the optimizer for the whole parameter: kept
        else:
            if not isinstance(out.get(k), Tensor):
                out[k] = torch.empty(p.shape, dtype=state_dtype, device=p.device)
            target = out[k] if whole else out[k].view(-1)[a:b]
            if v.data_ptr() != target.data_ptr() or v.dtype != target.dtype:  # not a view of the state: copy
                target.copy_(v.view(target.shape))
    state[p] = out
    return out


def _write_back(p: Tensor, c: Tensor | None, t: Tensor, key: int | None) -> None:
    """The core's rule on a whole parameter: ``p, c <- kahan_apply(p, c, t)`` or ``p <- stochastic_round(t)``."""
    if c is not None:
        new, c_new = kahan_apply(p, c, t, TORCH_ROUNDING_OPS)
        c.copy_(c_new)
    else:
        new = stochastic_round(t, key, TORCH_ROUNDING_OPS)
    p.copy_(new)


# The rules on one chunk, operation by operation as the core writes them (``kahan_add``, ``sr_thresholds``,
# ``round_with_thresholds``), into the reused buffers: no allocation (allocating each temporary page-faults).
# The tests hold them to the core's NumPy reference bit for bit.
def _kahan_chunk(w: Tensor, c: Tensor, t: Tensor, scratch: Scratch) -> None:
    """``w, c <- kahan_add(w, c, t - t0)``: ``t`` the optimizer's result, ``t0`` (scratch) ``f32(w) + f32(c)``."""
    n, dev = t.numel(), t.device
    u = t.sub_(scratch.get("t0", n, torch.float32, dev))
    y = scratch.get("y", n, w.dtype, dev).copy_(u).add_(c)  # low(u) + c
    new = torch.add(w, y, out=scratch.get("new", n, w.dtype, dev))
    torch.sub(new, w, out=c)
    torch.sub(y, c, out=c)  # c' = y - (new - w)
    w.copy_(new)


def _sr_chunk(w: Tensor, t: Tensor, key: int, offset: int, scratch: Scratch) -> None:
    """``w <- stochastic_round(t, key)`` for the elements with flat indices ``offset ..``: the upper half of
    ``f32 bits + (mix32(key ^ i) >> 16)``, NaN -> ``0x7FC0``."""
    n, dev = t.numel(), t.device
    x = scratch.get("x", n, torch.int32, dev)
    torch.add(scratch.arange(n, dev), offset, out=x).bitwise_xor_(s32(key))
    _sr_from_index(w, t, x, scratch)


def _sr_from_index(w: Tensor, t: Tensor, x: Tensor, scratch: Scratch) -> None:
    """``w <- stochastic_round(t)`` given int32 ``x = index ^ key`` per element (consumed): the rest of
    :func:`_sr_chunk`."""
    n, dev = t.numel(), t.device
    y = scratch.get("y32", n, torch.int32, dev)
    for shift, mul in ((16, MIX_MUL1), (15, MIX_MUL2)):  # the head of mix32
        torch.bitwise_right_shift(x, shift, out=y).bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(y).mul_(s32(mul))
    x.bitwise_right_shift_(16).bitwise_and_(0xFFFF)  # the 16-bit thresholds
    x.add_(t.view(torch.int32)).bitwise_right_shift_(16)
    bits = scratch.get("h", n, torch.int16, dev).copy_(x)  # the upper 16 bits (the lower half dropped)
    bits.masked_fill_(torch.ne(t, t, out=scratch.get("nan", n, torch.bool, dev)), s32(BF16_NAN_BITS) >> 16)
    w.copy_(bits.view(torch.bfloat16))
