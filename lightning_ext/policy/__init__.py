"""The recipe's operator policy applied to a ``torch.nn.Module`` tree.

The concept (the core's :mod:`mp_callbacks.policy`): low-precision ops (matmuls, linear, conv, attention)
compute in the recipe's compute dtype; FP32 ops (norms, softmax, losses, unknown custom leaves) compute in
FP32.  The rules here: an FP32 module's ``forward`` runs with autocast off and its floating inputs cast to
FP32 (:func:`apply_module_policy`); under recipes that store parameters in low precision the parameters of
modules the policy does not keep in FP32 are cast (:func:`cast_module_storage`; the parameter objects are
kept); :func:`policy_report` says what the policy decided per module.
"""

from .modules import (
    ModulePolicyHandle,
    apply_module_policy,
    buffers_to_fp32,
    cast_module_storage,
    fp32_compute_modules,
    policy_report,
    restore_module_storage,
    torch_dtype,
)

__all__ = ["ModulePolicyHandle", "apply_module_policy", "buffers_to_fp32", "cast_module_storage",
           "fp32_compute_modules", "policy_report", "restore_module_storage", "torch_dtype"]
