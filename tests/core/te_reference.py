"""Load Transformer Engine's pure-PyTorch NVFP4 reference (``reference_nvfp4.py``) without Transformer Engine.

``TE_REFERENCE_DIR`` names a directory holding ``reference_nvfp4.py``, ``reference_utils.py`` and
``gemm.py`` from ``transformer_engine/pytorch/custom_recipes/`` (none of it is in this repository).
The reference imports two base classes from ``transformer_engine.pytorch.quantized_tensor`` and the two
sibling modules; :func:`load_reference` supplies stand-ins of our own for the base classes (only what the
reference's quantizer touches: the usage flags) and loads the siblings from the same directory, under
temporary ``sys.modules`` entries that are removed again once the module is loaded.

:func:`te_cast` runs the reference quantizer on a float32 NumPy operand and returns what the tests compare:
the packed E2M1 codes, the E4M3 scale bits and the amax, rowwise (blocks along the last axis) and
columnwise (blocks along the first axis, the operand transposed, with the RHT when asked).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np

ENV = "TE_REFERENCE_DIR"
FILES = ("reference_nvfp4.py", "reference_utils.py", "gemm.py")
TE_COMMIT = "d0067d0da6cb01811b8072a7d304f0e00344ce2b"
"""The Transformer Engine commit the reference files (and the golden vectors) come from."""


def reference_dir() -> Path | None:
    """The directory of ``TE_REFERENCE_DIR`` when it is set and holds the reference files, else None."""
    value = os.environ.get(ENV)
    if not value:
        return None
    path = Path(value)
    return path if all((path / f).is_file() for f in FILES) else None


class QuantizedTensorStorage:
    """Stand-in for Transformer Engine's base of quantized tensors (the reference's dataclass needs a base)."""


class Quantizer:
    """Stand-in for Transformer Engine's quantizer base: the usage flags the reference reads."""

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True) -> None:
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_CACHE: dict[str, types.ModuleType] = {}


def load_reference(directory: Path) -> types.ModuleType:
    """``reference_nvfp4`` from ``directory``, its Transformer Engine imports served by stand-ins."""
    key = str(directory)
    if key in _CACHE:
        return _CACHE[key]
    base = "transformer_engine.pytorch"
    stand_ins = {
        "transformer_engine": types.ModuleType("transformer_engine"),
        base: types.ModuleType(base),
        f"{base}.quantized_tensor": types.ModuleType(f"{base}.quantized_tensor"),
        f"{base}.tensor": types.ModuleType(f"{base}.tensor"),
        f"{base}.tensor.utils": types.ModuleType(f"{base}.tensor.utils"),
        f"{base}.custom_recipes": types.ModuleType(f"{base}.custom_recipes"),
    }
    stand_ins[f"{base}.quantized_tensor"].QuantizedTensorStorage = QuantizedTensorStorage
    stand_ins[f"{base}.quantized_tensor"].Quantizer = Quantizer
    stand_ins[f"{base}.tensor.utils"].is_custom = lambda t: getattr(t, "custom", False)
    for module in stand_ins.values():
        module.__path__ = []  # packages, so that submodules resolve
    saved = {name: sys.modules.get(name) for name in [*stand_ins, f"{base}.custom_recipes.gemm",
                                                      f"{base}.custom_recipes.reference_utils",
                                                      f"{base}.custom_recipes.reference_nvfp4"]}
    try:
        sys.modules.update(stand_ins)
        recipes = stand_ins[f"{base}.custom_recipes"]
        recipes.reference_utils = _load(f"{base}.custom_recipes.reference_utils", directory / "reference_utils.py")
        recipes.gemm = _load(f"{base}.custom_recipes.gemm", directory / "gemm.py")
        module = _load(f"{base}.custom_recipes.reference_nvfp4", directory / "reference_nvfp4.py")
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    _CACHE[key] = module
    return module


def te_cast(ref: types.ModuleType, x: np.ndarray, tile: tuple[int, int] = (1, 16), rht: bool = False,
            dtype: str = "float32") -> dict[str, np.ndarray]:
    """Transformer Engine's reference cast of ``x`` ((rows, cols), float32 values; ``dtype`` the torch dtype the
    reference sees): packed codes (two a byte, as the reference stores them), E4M3 scale bits (one row per
    data row, a 2D tile's scale repeated over its 16 rows) and amax, rowwise and columnwise (``_t``).
    ``rht`` applies the RHT to the columnwise operand, as the recipe does for the weight-gradient operands."""
    import torch

    quantizer = ref.NVFP4QuantizerRef(dtype=ref.reference_utils.Fp4Formats.E2M1, rowwise=True, columnwise=True,
                                      quant_tile_shape=tile, with_rht=rht, with_random_sign_mask=True)
    out = quantizer.quantize(torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(getattr(torch, dtype)))
    return {"codes": out.data.numpy(), "scales": out.scale.view(torch.uint8).numpy(),
            "amax": out.global_amax_row.numpy().reshape(()),
            "codes_t": out.data_t.numpy(), "scales_t": out.scale_t.view(torch.uint8).numpy(),
            "amax_t": out.global_amax_col.numpy().reshape(())}
