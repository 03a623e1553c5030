"""Which Lightning strategies the plugin trains with.

Supported: single-device strategies and DDP (``ddp``, ``ddp_spawn``...).
Strategies that shard parameters or optimizer state, or bring their own
precision handling, are refused with the setting to use instead.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

__all__ = ["check_strategy"]

_UNSUPPORTED_STRATEGIES = {
    "DeepSpeedStrategy": "DeepSpeed's own fp16/bf16 config: Trainer(strategy='deepspeed', precision='16-mixed')",
    "FSDPStrategy": "FSDP's mixed precision: Trainer(strategy='fsdp', precision='bf16-mixed')",
    "ModelParallelStrategy": "the strategy's own precision settings (torch FSDP2 MixedPrecisionPolicy)",
    "XLAStrategy": "Trainer(accelerator='tpu', precision='bf16-true')",
    "SingleDeviceXLAStrategy": "Trainer(accelerator='tpu', precision='bf16-true')",
}


def check_strategy(strategy: Any) -> None:
    """Raise ``MisconfigurationException`` when ``strategy`` shards or re-implements precision handling."""
    if strategy is None:
        return
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    for cls in type(strategy).__mro__:
        if cls.__name__ in _UNSUPPORTED_STRATEGIES:
            raise MisconfigurationException(
                f"lightning_ext.MixedPrecision does not support {type(strategy).__name__}: that strategy shards "
                f"parameters or optimizer state and brings its own precision handling. Use "
                f"{_UNSUPPORTED_STRATEGIES[cls.__name__]}, or keep this plugin with strategy='ddp' / a single device."
            )
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise MisconfigurationException(
            f"lightning_ext.MixedPrecision supports single-device and DDP strategies, not "
            f"{type(strategy).__name__}. Use strategy='ddp' (or 'ddp_spawn'), or the strategy's own precision."
        )
