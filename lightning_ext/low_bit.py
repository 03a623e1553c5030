"""8-bit block-quantized Adam states in Lightning (``state_dtype="8bit"``): torchao's ``AdamW8bit`` as the step.

torchao's ``AdamW8bit`` stores m and v by the core's rule (:mod:`mp_callbacks.quantized_states`: the map,
block size and codes are tested bit for bit against it), so under the knob the user's ``torch.optim.AdamW``
becomes one, in place (:func:`eight_bit_inner`: the same object, parameter groups and hyperparameters; each
group's ``lr`` a tensor, as torchao wants and torch's LR schedulers fill).  Any other optimizer, ``amsgrad``,
or an AdamW that already holds state is a clear error.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from mp_callbacks.masters import MasterPlan
from mp_callbacks.quantized_states import BLOCK_SIZE

__all__ = ["eight_bit_inner"]


def eight_bit_inner(opt: Optimizer, plan: MasterPlan) -> Optimizer:
    """``opt``, turned into torchao's ``AdamW8bit`` in place when ``plan`` quantizes states (see the module)."""
    if not plan.quantized_states:
        return opt
    from torchao.optim import AdamW8bit

    if isinstance(opt, AdamW8bit):
        return opt
    if type(opt) is not torch.optim.AdamW:
        raise ValueError(f"state_dtype='8bit' block-quantizes AdamW's m and v with torchao's AdamW8bit: the "
                         f"optimizer must be torch.optim.AdamW (or torchao.optim.AdamW8bit), not {type(opt).__name__}")
    if any(g.get("amsgrad") or g.get("maximize") for g in opt.param_groups):
        raise ValueError("state_dtype='8bit': amsgrad and maximize are not offered (torchao's AdamW8bit)")
    if any(len(s) for s in opt.state.values()):
        raise ValueError("state_dtype='8bit': the AdamW already holds FP32 state; set the recipe up before the "
                         "first step (a checkpoint of FP32 states does not load into 8-bit ones)")
    opt.__class__ = AdamW8bit
    opt.block_size, opt.bf16_stochastic_round, opt.is_adamw = BLOCK_SIZE, False, True
    for group in opt.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
    opt._patch_step_function()
    return opt
