"""Regenerate tests/core/data/nvfp4_te_golden.npz: Transformer Engine's reference NVFP4 casts of the test operands.

Run from the repository root with the reference files at hand (``reference_nvfp4.py``,
``reference_utils.py``, ``gemm.py`` from ``transformer_engine/pytorch/custom_recipes/`` at the commit
in :data:`tests.core.te_reference.TE_COMMIT`)::

    TE_REFERENCE_DIR=/path/to/them python -m tests.core.make_nvfp4_golden

For every operand of :func:`tests.core.nvfp4_cases.cases` the file holds the operand and, per variant
(``1x16``, ``2d``: 16 x 16 tiles, ``rht``: 1 x 16 with the RHT on the columnwise operand), the
reference's packed E2M1 codes, E4M3 scale bits and amax, rowwise (blocks along the last axis) and
columnwise (the transposed operand); ``rht`` also holds the reference's transformed operand ``rht_t``.
The file records the Transformer Engine commit (``te_commit``).  No Transformer Engine code is stored.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .nvfp4_cases import cases
from .te_reference import ENV, TE_COMMIT, load_reference, reference_dir, te_cast

GOLDEN = Path(__file__).resolve().parent / "data" / "nvfp4_te_golden.npz"
VARIANTS = {"1x16": ((1, 16), False), "2d": ((16, 16), False), "rht": ((1, 16), True)}


def golden_arrays(directory: Path) -> dict[str, np.ndarray]:
    """What the golden file holds, computed now by the reference in ``directory``."""
    import torch

    ref = load_reference(directory)
    out: dict[str, np.ndarray] = {"te_commit": np.array(TE_COMMIT), "cases": np.array(sorted(cases()))}
    for name, x in sorted(cases().items()):
        out[f"{name}/x"] = x
        for variant, (tile, rht) in VARIANTS.items():
            for field, value in te_cast(ref, x, tile, rht).items():
                if variant == "rht" and not field.endswith("_t"):
                    continue  # the rowwise operand is not transformed: the 1x16 variant's
                out[f"{name}/{variant}/{field}"] = value
        quantizer = ref.NVFP4QuantizerRef(dtype=ref.reference_utils.Fp4Formats.E2M1, quant_tile_shape=(1, 16),
                                          with_rht=True)
        out[f"{name}/rht/rht_t"] = quantizer._apply_rht(torch.from_numpy(np.ascontiguousarray(x.T))).numpy()
    return out


def main() -> int:
    directory = reference_dir()
    if directory is None:
        print(f"set {ENV} to a directory holding Transformer Engine's reference_nvfp4.py, reference_utils.py "
              "and gemm.py", file=sys.stderr)
        return 2
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(GOLDEN, **golden_arrays(directory))
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
