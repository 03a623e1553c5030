"""Operator precision policy: which ops and modules run in low precision.

Rules, in order of precedence, for a module or layer:

1. explicit module rules (``{"pattern": dtype}``), first match wins; a pattern
   matches the class name of the module or of any of its base classes
   exactly, or the dotted path as a glob (``"encoder.*.attn"``);
2. the nearest class in the module's class hierarchy that maps to an op kind
   (``Linear`` -> ``linear``, ``LayerNorm`` -> ``layer_norm``...; a
   ``class MyDense(Dense)`` resolves as ``Dense``), then the op rules below;
3. anything else is *unknown* and runs in FP32.

For an op kind: in ``low_precision_ops`` -> the compute dtype; in
``fp32_ops`` -> float32; in ``float16_fp32_ops`` (elementwise ops whose
intermediates leave float16's range: GPT-2's tanh GELU cubes its input, inf in
float16 from ``|x| > 40``) -> float32 when the compute dtype is float16, else
passthrough (bfloat16 has float32's range); in ``passthrough_ops`` (elementwise activations,
dropout, reshapes) -> the compute dtype (they follow their input); otherwise
unknown -> float32.  Unknown or custom ops run in FP32 unless declared.

A *composite* (a module that holds submodules, e.g. a transformer block) is
decided by :meth:`PrecisionPolicy.explain_composite`: a module rule on it, else
its own op kind when known (``MultiHeadAttention``), else it computes what it
holds: the compute dtype when one of its submodules does, float32 otherwise.
Its submodules keep their own decisions (a softmax or a norm inside stays
FP32), except that an FP32 module rule on a composite holds for its whole
subtree, and a passthrough submodule follows its composite.  Where a
submodule computes in another dtype than its composite, its outputs are cast
to the composite's dtype (:func:`boundary_cast`): every tensor that meets
another inside the composite has one dtype, as under autocast.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .dtypes import canonical_dtype

DEFAULT_LOW_PRECISION_OPS = frozenset({
    "matmul", "bmm", "baddbmm", "addmm", "mm", "einsum", "linear", "dense", "einsum_dense",
    "conv", "conv1d", "conv2d", "conv3d", "conv_transpose", "attention", "multi_head_attention",
    "scaled_dot_product_attention", "lstm", "gru", "rnn",
})
DEFAULT_FP32_OPS = frozenset({
    "softmax", "log_softmax", "layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm",
    "normalization", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "bce", "bce_with_logits",
    "kl_div", "loss", "exp", "log", "pow", "sum", "mean", "norm", "cumsum", "prod", "logsumexp",
    "softplus", "embedding",
})
DEFAULT_FLOAT16_FP32_OPS = frozenset({"tanh_gelu"})
DEFAULT_PASSTHROUGH_OPS = frozenset({
    "relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "elu", "activation", "dropout",
    "identity", "flatten", "reshape", "add", "max_pool", "avg_pool", "pool", "concatenate",
})

# Class names (torch.nn and keras.layers) -> op kind.
CLASS_TO_OP: dict[str, str] = {
    "Linear": "linear", "Bilinear": "linear", "Dense": "dense", "EinsumDense": "einsum_dense",
    "Conv1d": "conv1d", "Conv2d": "conv2d", "Conv3d": "conv3d", "Conv1D": "conv1d",
    "Conv2D": "conv2d", "Conv3D": "conv3d", "ConvTranspose1d": "conv_transpose",
    "ConvTranspose2d": "conv_transpose", "ConvTranspose3d": "conv_transpose",
    "Conv1DTranspose": "conv_transpose", "Conv2DTranspose": "conv_transpose",
    "MultiheadAttention": "attention", "MultiHeadAttention": "attention",
    "LSTM": "lstm", "GRU": "gru", "RNN": "rnn",
    "Softmax": "softmax", "LogSoftmax": "log_softmax",
    "LayerNorm": "layer_norm", "LayerNormalization": "layer_norm", "RMSNorm": "rms_norm",
    "RMSNormalization": "rms_norm", "GroupNorm": "group_norm", "GroupNormalization": "group_norm",
    "BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm", "BatchNorm3d": "batch_norm",
    "BatchNormalization": "batch_norm", "InstanceNorm1d": "instance_norm",
    "InstanceNorm2d": "instance_norm", "Embedding": "embedding",
    "CrossEntropyLoss": "cross_entropy", "NLLLoss": "nll_loss", "MSELoss": "mse_loss",
    "ReLU": "relu", "GELU": "gelu", "SiLU": "silu", "Tanh": "tanh", "Sigmoid": "sigmoid",
    "LeakyReLU": "leaky_relu", "ELU": "elu", "Activation": "activation", "Dropout": "dropout",
    "Identity": "identity", "Flatten": "flatten", "Reshape": "reshape", "Add": "add",
    "MaxPool1d": "max_pool", "MaxPool2d": "max_pool", "AvgPool2d": "avg_pool",
    "MaxPooling2D": "max_pool", "AveragePooling2D": "avg_pool", "GlobalAveragePooling2D": "avg_pool",
    "GlobalAveragePooling1D": "avg_pool", "Concatenate": "concatenate", "InputLayer": "identity",
    # Hugging Face transformers' activation modules (transformers.activations): plain tensor ops.
    "NewGELUActivation": "tanh_gelu", "GELUTanh": "tanh_gelu", "PytorchGELUTanh": "tanh_gelu",
    "FastGELUActivation": "tanh_gelu", "GELUActivation": "gelu", "QuickGELUActivation": "gelu",
    "SiLUActivation": "silu",
}

_FIELDS = ("params", "compute", "output")


_GENERIC_BASES = frozenset({"object", "Module", "Layer", "Operation", "KerasSaveable", "Tracker", "AutoTrackable",
                            "Trackable", "LightningModule", "Model", "Generic", "Protocol"})


def class_names(op_or_module: Any) -> list[str]:
    """An op/class name as given, or an object's class names nearest first (its base classes up to,
    not including, the frameworks' generic bases such as ``Module``/``Layer``)."""
    if isinstance(op_or_module, str):
        return [op_or_module]
    names = [c.__name__ for c in type(op_or_module).__mro__ if c.__name__ not in _GENERIC_BASES]
    return names or [type(op_or_module).__name__]


class PolicyError(ValueError):
    """A policy string, dtype, op name or rule is invalid."""


def _dtype(value: Any, name: str) -> str:
    try:
        return canonical_dtype(value, field=name)
    except ValueError as exc:
        raise PolicyError(str(exc)) from None


def _ops(values: Iterable[str], name: str) -> frozenset[str]:
    if isinstance(values, str):
        raise PolicyError(f"{name} must be a collection of op names, not the string {values!r}")
    out = set()
    for v in values:
        if not isinstance(v, str) or not v:
            raise PolicyError(f"{name} holds {v!r}; op names are non-empty strings")
        out.add(v.lower())
    return frozenset(out)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of parameters, compute and outputs, plus op and module rules.

    >>> p = PrecisionPolicy.parse("params=float32,compute=bfloat16,output=float32")
    >>> p.resolve("linear"), p.resolve("softmax"), p.resolve("my_custom_op")
    ('bfloat16', 'float32', 'float32')
    """

    params: str = "float32"
    compute: str = "float32"
    output: str = "float32"
    low_precision_ops: frozenset[str] = DEFAULT_LOW_PRECISION_OPS
    fp32_ops: frozenset[str] = DEFAULT_FP32_OPS
    passthrough_ops: frozenset[str] = DEFAULT_PASSTHROUGH_OPS
    float16_fp32_ops: frozenset[str] = DEFAULT_FLOAT16_FP32_OPS
    module_rules: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in _FIELDS:
            object.__setattr__(self, name, _dtype(getattr(self, name), name))
        for name in ("low_precision_ops", "fp32_ops", "passthrough_ops", "float16_fp32_ops"):
            object.__setattr__(self, name, _ops(getattr(self, name), name))
        both = self.low_precision_ops & self.fp32_ops
        if both:
            raise PolicyError(f"ops {sorted(both)} are in both low_precision_ops and fp32_ops")
        rules = self.module_rules
        if isinstance(rules, Mapping):
            rules = tuple(rules.items())
        checked = []
        for item in rules:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) and item[0]):
                raise PolicyError(f"module rule {item!r} must be a (pattern, dtype) pair")
            checked.append((item[0], _dtype(item[1], f"module rule {item[0]!r}")))
        object.__setattr__(self, "module_rules", tuple(checked))

    # -- strings --------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, **kwargs: Any) -> PrecisionPolicy:
        """From ``"params=float32,compute=bfloat16,output=float32"`` (omitted fields: float32)."""
        if not isinstance(text, str) or not text.strip():
            raise PolicyError(f"a policy string must be non-empty text like {cls().format()!r}, got {text!r}")
        values: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not sep or not value:
                raise PolicyError(f"policy string {text!r}: {part.strip()!r} is not key=dtype")
            if key not in _FIELDS:
                raise PolicyError(f"policy string {text!r}: unknown key {key!r}; valid keys: {', '.join(_FIELDS)}")
            if key in values:
                raise PolicyError(f"policy string {text!r}: {key!r} given twice")
            values[key] = value
        return cls(**values, **kwargs)

    def format(self) -> str:
        """Inverse of :meth:`parse` (dtypes only)."""
        return ",".join(f"{name}={getattr(self, name)}" for name in _FIELDS)

    # -- rules ----------------------------------------------------------------
    def with_fp32_modules(self, *patterns: str) -> PrecisionPolicy:
        """A copy that keeps modules matching ``patterns`` in float32 (added first)."""
        new = tuple((p, "float32") for p in patterns if (p, "float32") not in self.module_rules)
        return replace(self, module_rules=new + self.module_rules)

    def op_kind(self, op_or_module: Any) -> str:
        """The op kind of a name, a class name or an object (its nearest class in :data:`CLASS_TO_OP`)."""
        names = class_names(op_or_module)
        return next((CLASS_TO_OP[n] for n in names if n in CLASS_TO_OP), names[0].lower())

    def classify_op(self, op: str) -> str:
        """``"low"``, ``"fp32"``, ``"passthrough"`` or ``"unknown"`` for an op kind."""
        op = op.lower()
        if op in self.fp32_ops:
            return "fp32"
        if op in self.low_precision_ops:
            return "low"
        if op in self.float16_fp32_ops:
            return "fp32" if self.compute == "float16" else "passthrough"
        if op in self.passthrough_ops:
            return "passthrough"
        return "unknown"

    def match_module_rule(self, class_name: str | Iterable[str], path: str = "") -> str | None:
        """The dtype of the first module rule that matches (a class name in ``class_name``, or ``path``), else None."""
        names = {class_name} if isinstance(class_name, str) else set(class_name)
        for pattern, dtype in self.module_rules:
            if pattern in names or (path and fnmatch.fnmatchcase(path, pattern)):
                return dtype
        return None

    def explain(self, op_or_module: Any, path: str = "") -> tuple[str, str]:
        """``(compute dtype, why)`` for an op name, a class name or a module/layer at ``path``."""
        names = class_names(op_or_module)
        for pattern, dtype in self.module_rules:
            if pattern in names or (path and fnmatch.fnmatchcase(path, pattern)):
                return dtype, f"module rule {pattern!r}"
        via = next((n for n in names if n in CLASS_TO_OP), None)
        kind = CLASS_TO_OP[via] if via is not None else names[0].lower()
        klass = self.classify_op(kind)
        origin = "" if via in (None, names[0]) else f" (a {via})"
        if klass in ("low", "passthrough"):
            return self.compute, f"{kind}{origin}: {'low-precision' if klass == 'low' else 'passthrough'} op"
        if klass == "fp32":
            return "float32", f"{kind}{origin}: FP32 op"
        return "float32", f"unknown {names[0]}: FP32 unless declared"

    def explain_composite(self, op_or_module: Any, path: str, inner: Iterable[str]) -> tuple[str, str]:
        """``(compute dtype, why)`` of a module holding submodules whose compute dtypes are ``inner``
        (see the module docstring): a module rule, else its known op kind, else what it holds."""
        names = class_names(op_or_module)
        rule = self.match_module_rule(names, path)
        if rule is not None or self.classify_op(self.op_kind(op_or_module)) != "unknown":
            return self.explain(op_or_module, path)
        if self.compute != "float32" and self.compute in set(inner):
            return self.compute, f"{names[0]} holds sublayers computing in {self.compute}: computes like them"
        return "float32", f"{names[0]} holds only FP32 sublayers"

    def resolve(self, op_or_module: Any, path: str = "") -> str:
        """The dtype ``op_or_module`` computes in (``path``: its dotted name in the model)."""
        return self.explain(op_or_module, path)[0]

    def keeps_fp32(self, op_or_module: Any, path: str = "") -> bool:
        """True when the module must run (and, under master recipes, store params) in FP32."""
        return self.compute != "float32" and self.resolve(op_or_module, path) == "float32"

    # -- plain data ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (sorted lists), for checkpoints and JSON."""
        return {
            "params": self.params, "compute": self.compute, "output": self.output,
            "low_precision_ops": sorted(self.low_precision_ops), "fp32_ops": sorted(self.fp32_ops),
            "passthrough_ops": sorted(self.passthrough_ops), "float16_fp32_ops": sorted(self.float16_fp32_ops),
            "module_rules": [list(r) for r in self.module_rules],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionPolicy:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        valid = set(cls().to_dict())
        unknown = sorted(set(data) - valid)
        if unknown:
            raise PolicyError(f"unknown policy key(s) {unknown}; valid keys: {sorted(valid)}")
        kwargs = dict(data)
        if "module_rules" in kwargs:
            kwargs["module_rules"] = tuple(tuple(r) for r in kwargs["module_rules"])
        return cls(**kwargs)


def boundary_cast(inner: str, outer: str | None) -> str | None:
    """The dtype a submodule computing in ``inner`` casts its outputs to inside a composite computing in
    ``outer`` (None: no cast; ``outer`` None: not inside a composite)."""
    return outer if outer is not None and outer != inner else None


def added_fp32_rules(saved: Any, current: PrecisionPolicy) -> list[str]:
    """The FP32 module rules of checkpointed policy ``saved`` (a dict) that ``current`` lacks.

    These are rules a run added while training (the auto-fallback's
    ``with_fp32_modules``) and a resume must re-apply.  A saved policy that is
    invalid or has other dtypes is a :class:`~mp_callbacks.loss_scale.scaler.StateDictError` naming both.
    """
    from .settings import StateDictError

    try:
        policy = PrecisionPolicy.from_dict(saved)
    except (ValueError, TypeError) as exc:
        raise StateDictError(f"the checkpoint holds an invalid policy: {exc}") from None
    if (policy.params, policy.compute) != (current.params, current.compute):
        raise StateDictError(f"the checkpoint was saved with policy {policy.format()!r}; this run uses "
                             f"{current.format()!r}")
    return [pattern for pattern, dtype in policy.module_rules
            if dtype == "float32" and (pattern, dtype) not in current.module_rules]


def format_report(rows: Iterable[Mapping[str, str]]) -> str:
    """A policy report (rows of ``path``, ``class``, ``compute``, ``storage``, ``why``) as an aligned text table."""
    header = ("path", "class", "compute", "storage", "why")
    table = [header] + [tuple(str(r.get(k, "")) for k in header) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
                     for row in table)
