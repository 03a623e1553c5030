"""What to try when training overflows or diverges: the one checklist every error message quotes.

Each item answers some causes: ``"loss"`` (a non-finite loss: a forward problem),
``"overflow"`` (gradients overflow at a finite loss with the scale already below 1) and
``"floor"`` (gradients keep overflowing with the loss scale at its floor).  The float16 ->
bfloat16 item is left out when the run already computes in another dtype.

>>> checklist("overflow", compute="bfloat16")
'lower the learning rate (or warm it up), clip gradients, keep more ops in FP32 (norms, softmax, losses, '
'custom ops: PrecisionPolicy.with_fp32_modules)'
"""

from __future__ import annotations

CAUSES = ("loss", "overflow", "floor")

CHECKLIST: tuple[tuple[str, frozenset[str]], ...] = (
    ("check the inputs and labels for inf/NaN", frozenset({"loss"})),
    ("lower the learning rate (or warm it up)", frozenset(CAUSES)),
    ("clip gradients", frozenset({"overflow"})),
    ("keep more ops in FP32 (norms, softmax, losses, custom ops: PrecisionPolicy.with_fp32_modules)",
     frozenset(CAUSES)),
    ("switch float16 to bfloat16 (wider range)", frozenset(CAUSES)),
    ("check the data for extreme values", frozenset({"floor"})),
    ("turn on overflow attribution (MixedPrecisionMonitor(attribute_overflows=True)) to name the first "
     "non-finite module", frozenset({"loss", "floor"})),
)
"""``(advice, causes it answers)``, in the order messages list them."""

FLOAT16_ITEM = CHECKLIST[4][0]


def checklist(cause: str, compute: str | None = None) -> str:
    """The advice for ``cause``, joined with commas (``compute``: the run's compute dtype, if known)."""
    if cause not in CAUSES:
        raise ValueError(f"cause={cause!r} must be one of {', '.join(CAUSES)}")
    skip_fp16 = compute is not None and compute not in ("float16", "fp16", "half")
    return ", ".join(text for text, causes in CHECKLIST
                     if cause in causes and not (skip_fp16 and text == FLOAT16_ITEM))
