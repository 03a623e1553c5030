"""The rounded parameters of one param group stepped together: the fast path of ``bf16-kahan``/``bf16-sr``.

The rule is :func:`~lightning_ext.rounding_step.update_parameter`'s, bit for bit: torch's fused Adam/AdamW
kernel updates the FP32 value ``t`` (``f32(w) + f32(c)`` under Kahan, ``f32(w)`` under SR) from the FP32
gradient and the FP32 state, and the core's rule writes ``t`` back (the same operations, on the same
elements).  It applies where that function calls the kernel directly: exact ``Adam``/``AdamW`` with the
implementation left to torch (or ``fused=True``), the state already in the kernel's form (from the second
update of a parameter on; ``state_dtype`` ``bfloat16``: through FP32 copies of the segment's states, stored
back rounded to nearest as that function stores them), contiguous tensors.

How: the group's parameters are cut into segments of at most ``segment`` elements (:data:`CHUNK`): a large
parameter into slices (multiples of 64 elements, as the chunks of
:func:`~lightning_ext.rounding_step.update_parameter`), small ones packed together.  A segment is one call of
the kernel over the list of its pieces and one pass of each operation of the rule over the segment's
buffers (the :class:`~lightning_ext.rounding_step.Scratch` buffers of the chunked step, plus two bf16 ones of
a segment for the packed weights and compensation, and under SR the packed elements' indices), with no
mixed-dtype operation (on CPU each would cast
through a hidden FP32 temporary).  The segments and their views are kept between steps, and rebuilt when
the parameters, their state tensors or the buffers change.  Each parameter's step count is incremented once
(``torch._foreach_add_``, as torch's fused path does); its bf16 gradient is released after the update.

Kahan on CPU (bf16 weights, one intra-op thread): the value build before the kernel and the write-back after it
are one native pass each (:mod:`lightning_ext.kahan_native`: the same operations and roundings in a loop of C,
bit for bit these eager passes), built with the C compiler at the first step (~0.2 s, then cached on disk).
Switch: ``lightning_ext.kahan_native.NATIVE = False`` keeps the eager passes; they are also used, after one
warning, where no compiler is found or the built library fails its check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import _to_scalar

from mp_callbacks.weights import s32

from .kahan_native import NativeKahan, native_kahan
from .rounding_step import CHUNK, Scratch, _direct_adam, _sr_from_index

__all__ = ["BatchedStep"]

_PLAIN = (Tensor, torch.nn.Parameter)


class _Segment:
    """One segment: ``parts`` ``(item, a, b, offset)`` (elements ``a..b`` of a parameter at ``offset``)."""

    __slots__ = ("n", "packed", "parts", "t", "t0", "g", "tv", "gv", "m", "v", "mx", "w", "c", "wl", "cl", "wv",
                 "cv", "idx", "ids", "y", "new", "pre", "src", "post", "post_src", "sl", "sb")

    def __init__(self, parts: list[tuple[int, int, int, int]]) -> None:
        self.parts = parts
        self.n = parts[-1][3] + parts[-1][2] - parts[-1][1]
        self.packed = len(parts) > 1


class BatchedStep:
    """Steps a param group's rounded parameters segment by segment (see the module docstring); keeps the
    segments of each group between steps."""

    def __init__(self) -> None:
        self.segment = CHUNK
        self._plans: dict[int, tuple[tuple, list[_Segment]]] = {}

    def clear(self) -> None:
        """Forget the kept segments (rebuilt at the next step)."""
        self._plans.clear()

    def step(self, opt: Optimizer, group: dict, params: Sequence[Tensor], comps: Sequence[Tensor | None],
             keys: Sequence[int | None], kahan: bool, state_dtype: torch.dtype, scratch: Scratch,
             segment: int = CHUNK) -> list[int]:
        """Update the parameters of ``group`` this path applies to (compensation ``comps[i]`` under Kahan, SR key
        ``keys[i]`` otherwise) in segments of at most ``segment`` elements (rounded down to a multiple of 64);
        returns the positions of those it left to the per-parameter step."""
        self.segment = max(64, segment // 64 * 64)
        state, take, rest = opt.state, [], []
        device = None
        for i, p in enumerate(params):
            st = state.get(p)
            if st is not None and self._fits(opt, group, p, comps[i], st, state_dtype, device):
                device = p.device
                take.append(i)
            else:
                rest.append(i)
        if not take:
            return rest
        items = [(params[i], comps[i], state[params[i]]) for i in take]
        segments = self._plan(id(group), items, kahan, state_dtype != torch.float32, scratch, device)
        _run(group, items, [keys[i] for i in take], segments, kahan, scratch, device)
        for p, _, _ in items:
            p.grad = None  # spent
        return rest

    @staticmethod
    def _fits(opt: Optimizer, group: dict, p: Tensor, c: Tensor | None, st: dict, state_dtype: torch.dtype,
              device: Any) -> bool:
        g = p.grad
        if state_dtype not in (torch.float32, torch.bfloat16) or type(g) not in _PLAIN or type(p) not in _PLAIN:
            return False
        if not _direct_adam(opt, group, st, state_dtype, states=state_dtype):
            return False
        if device is not None and p.device != device:
            return False
        if not (p.is_contiguous() and g.is_contiguous() and (c is None or c.is_contiguous())):
            return False
        n = p.numel()
        return all(type(v) is Tensor and v.is_contiguous() and v.numel() == n and v.device == p.device
                   for k, v in st.items() if k != "step")

    def _plan(self, gid: int, items: list, kahan: bool, low: bool, scratch: Scratch,
              device: Any) -> list[_Segment]:
        """The kept segments of the group, rebuilt when anything they view changed (``low``: bf16 states)."""
        layout = _layout([p.numel() for p, _, _ in items], self.segment)
        top = max(s.n for s in layout)
        bufs = _buffers(scratch, top, items[0][0].dtype, device)
        sbufs = {k: scratch.get(f"state:{k}", top, torch.float32, device)
                 for k in items[0][2] if k != "step"} if low else {}
        key = (kahan, low, self.segment, tuple(b.data_ptr() for b in sbufs.values()), tuple(b.data_ptr() for b in bufs),
               tuple((id(p), p.data_ptr(), p.numel(), 0 if c is None else c.data_ptr(),
                      *(v.data_ptr() for k, v in st.items() if k != "step")) for p, c, st in items))
        kept = self._plans.get(gid)
        if kept is not None and kept[0] == key:
            return kept[1]
        _build(layout, items, kahan, bufs, sbufs, device)
        self._plans[gid] = (key, layout)
        return layout


def _layout(sizes: list[int], seg: int) -> list[_Segment]:
    """Parameters of ``sizes`` elements in segments of at most ``seg``: the large ones sliced, the small packed."""
    out, pack, size = [], [], 0
    for j, n in enumerate(sizes):
        if n >= seg:
            out += [_Segment([(j, a, min(n, a + seg), 0)]) for a in range(0, n, seg)]
            continue
        if pack and size + n > seg:
            out.append(_Segment(pack))
            pack, size = [], 0
        pack.append((j, 0, n, size))
        size += n
    if pack:
        out.append(_Segment(pack))
    return out


def _build(out: list[_Segment], items: list, kahan: bool, bufs: tuple[Tensor, ...], sbufs: dict[str, Tensor],
           device: Any) -> None:
    """The segments' views of the parameters, their compensation and state, and of the buffers (``sbufs``: the
    FP32 copies of bf16 states, by key; empty for FP32 states, which the kernel updates in place)."""
    t, t0, g, wb, cb, y, new = bufs
    for s in out:
        s.t, s.t0, s.g, s.y, s.new = t[:s.n], t0[:s.n], g[:s.n], y[:s.n], new[:s.n]
        flat = [(items[j][0].detach().view(-1), items[j][1], items[j][2], a, b, o) for j, a, b, o in s.parts]
        s.tv = [t[o:o + b - a] for _, _, _, a, b, o in flat]
        s.gv = [g[o:o + b - a] for _, _, _, a, b, o in flat]
        names = [k for k in items[s.parts[0][0]][2] if k != "step"]
        views = {k: [st[k].view(-1)[a:b] for _, _, st, a, b, _ in flat] for k in names}
        s.sl = [v for k in names for v in views[k]] if sbufs else []  # bf16 states: FP32 copies for the kernel
        if sbufs:
            views = {k: [sbufs[k][o:o + b - a] for _, _, _, a, b, o in flat] for k in names}
        s.sb = [v for k in names for v in views[k]] if sbufs else []
        s.m, s.v, s.mx = views["exp_avg"], views["exp_avg_sq"], views.get("max_exp_avg_sq", [])
        s.wl = [w[a:b] for w, _, _, a, b, _ in flat]
        s.cl = [c.view(-1)[a:b] for _, c, _, a, b, _ in flat] if kahan else []
        s.wv = [wb[o:o + b - a] for _, _, _, a, b, o in flat]
        s.cv = [cb[o:o + b - a] for _, _, _, a, b, o in flat]
        s.w = wb[:s.n] if s.packed else s.wl[0]
        s.c = (cb[:s.n] if s.packed else s.cl[0]) if kahan else None
        # the copies before the kernel (the gradients' views are the step's): into the FP32 buffers directly,
        # or, packed, into the weight (and compensation) buffers first
        if s.packed:
            s.pre, s.src = s.wv + s.cv[:len(s.cl)] + s.sb + s.gv, s.wl + s.cl + s.sl
            s.post, s.post_src = [s.t, s.t0][:1 + kahan], [s.w, s.c][:1 + kahan]
        else:
            s.pre, s.src = [s.t, s.t0][:1 + kahan] + s.sb + [s.g], [s.w, s.c][:1 + kahan] + s.sl
        s.idx = s.ids = None
        if s.packed and not kahan:  # each element's index in its parameter, and which part it is in
            s.idx = torch.cat([torch.arange(a, b, dtype=torch.int32, device=device) for _, a, b, _ in s.parts])
            s.ids = torch.cat([torch.full((b - a,), k, dtype=torch.int32, device=device)
                               for k, (_, a, b, _) in enumerate(s.parts)])


def _buffers(scratch: Scratch, n: int, dtype: torch.dtype, device: Any) -> tuple[Tensor, ...]:
    """The segment buffers: FP32 ``t``, ``t0``, ``g``, the rule's ``y`` and ``new`` (the chunked step's) and the
    packed weight/compensation."""
    f32 = torch.float32
    return (scratch.get("t", n, f32, device), scratch.get("t0", n, f32, device), scratch.get("g", n, f32, device),
            scratch.get("wb", n, dtype, device), scratch.get("cb", n, dtype, device),
            scratch.get("y", n, dtype, device), scratch.get("new", n, dtype, device))


def _run(group: dict, items: list, keys: list, segments: list[_Segment], kahan: bool, scratch: Scratch,
         device: Any) -> None:
    """Count the steps, then per segment: FP32 value and gradient, the kernel on the pieces, the rule (Kahan:
    :func:`~lightning_ext.rounding_step._kahan_chunk`'s operations, inline on the kept views, or in one native
    pass each side of the kernel: :func:`_native`)."""
    steps = [st["step"] for _, _, st in items]
    torch._foreach_add_(steps, 1)
    kernel = _kernel(group)
    grads = [p.grad.view(-1) for p, _, _ in items]
    native = _native(items, kahan, device)
    copy, add, sub = torch._foreach_copy_, torch.add, torch.sub
    for s in segments:
        t, t0, w, c = s.t, s.t0, s.w, s.c
        if s.packed:  # gather the weights (and compensation) and the FP32 gradients, then the FP32 values
            copy(s.pre, s.src + [grads[j] for j, _, _, _ in s.parts])
            if native is not None:
                native.value(w, c, t)
            else:
                copy(s.post, s.post_src)
        elif native is not None:  # t = f32(w) + f32(c) and the FP32 gradient in one pass (t0 is not kept)
            j, a, b, _ = s.parts[0]
            if s.sl:
                copy(s.sb, s.sl)
            native.value(w, c, t, grads[j][a:b], s.g)
        else:
            j, a, b, _ = s.parts[0]
            copy(s.pre, s.src + [grads[j][a:b]])
        if kahan and native is None:  # t = f32(w) + t0 with t0 = f32(c); then t0 = t (u = t_new - t0 after the kernel)
            t.add_(t0)
            t0.copy_(t)
        kernel(s.tv, s.gv, s.m, s.v, s.mx, [steps[j] for j, _, _, _ in s.parts])
        if s.sl:  # bf16 states: the kernel's FP32 results rounded to nearest, as the per-parameter step stores them
            copy(s.sl, s.sb)
        if native is not None:  # the same rule in one pass, t0 recomputed from w and c
            native.write(t, w, c)
        elif kahan:  # y = low(u) + c; new = w + y; c' = y - (new - w)
            y, new = s.y, s.new
            t.sub_(t0)
            y.copy_(t).add_(c)
            add(w, y, out=new)
            sub(new, w, out=c)
            sub(y, c, out=c)
            w.copy_(new)
        else:
            n = s.n
            x = scratch.get("x", n, torch.int32, device)
            if s.packed:
                ks = torch.tensor([s32(keys[j]) for j, _, _, _ in s.parts], dtype=torch.int32, device=device)
                torch.bitwise_xor(s.idx, torch.index_select(ks, 0, s.ids, out=scratch.get("k", n, torch.int32,
                                                                                          device)), out=x)
            else:
                j, a, _, _ = s.parts[0]
                torch.add(scratch.arange(n, device), a, out=x).bitwise_xor_(s32(keys[j]))
            _sr_from_index(w, t, x, scratch)
        if s.packed:
            copy(s.wl + s.cl, s.wv + (s.cv if kahan else []))
    if native is not None:  # written behind torch's back: autograd's in-place check still sees the change
        torch.autograd.graph.increment_version([x for p, c, _ in items for x in (p, c)])


def _native(items: list, kahan: bool, device: Any) -> NativeKahan | None:
    """The native Kahan passes (:mod:`lightning_ext.kahan_native`) where they apply: Kahan, CPU, bf16 weights
    and compensation; else None."""
    if not kahan or device.type != "cpu":
        return None
    bf16 = torch.bfloat16
    if not all(p.dtype == bf16 and c.dtype == bf16 for p, c, _ in items):
        return None
    return native_kahan()


def _kernel(group: dict) -> Callable[..., None]:
    """torch's fused Adam/AdamW kernel with the group's hyperparameters (the arguments torch's fused path passes)."""
    fn = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
    beta1, beta2 = (_to_scalar(b) for b in group["betas"])
    amsgrad = bool(group.get("amsgrad"))
    kw = dict(amsgrad=amsgrad, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=bool(group.get("maximize")), grad_scale=None, found_inf=None)

    def run(t: list, g: list, m: list, v: list, mx: list, steps: list) -> None:
        fn(t, g, m, v, mx if amsgrad else [], steps, **kw)

    return run
