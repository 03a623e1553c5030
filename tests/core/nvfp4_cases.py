"""The operands the NVFP4 cast tests compare against torchao and Transformer Engine's reference.

Each case is a float32 ``(32, 32)`` operand (whole 16 x 16 tiles, so the rowwise, 2D and transposed
casts all apply), built from a fixed seed.  :func:`cases` gives the finite ones, :func:`nonfinite_cases`
the ones holding inf or NaN (compared through their flags, not their bits).
"""

from __future__ import annotations

import numpy as np

SHAPE = (32, 32)
TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
"""The magnitudes exactly halfway between neighbouring E2M1 values (and the max)."""


def cases() -> dict[str, np.ndarray]:
    """Random and adversarial finite operands, by name."""
    rng = np.random.default_rng(20260)
    m, k = SHAPE
    out: dict[str, np.ndarray] = {}
    out["random"] = rng.standard_normal(SHAPE).astype(np.float32)
    out["bf16_values"] = _bf16(rng.standard_normal(SHAPE) * 3)
    out["wide_rows"] = (rng.standard_normal(SHAPE) * np.exp(rng.uniform(-20, 20, (m, 1)))).astype(np.float32)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    x[:, [3, 5, 17]] *= 1000  # outlier channels, as LLM activations
    out["outlier_channels"] = x
    out["zeros"] = np.zeros(SHAPE, np.float32)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    x[3, 0:16] = 0  # one zero 1 x 16 block ...
    x[3, 0:8] = -0.0  # ... half of it negative zeros
    x[9, 5] = -0.0
    x[16:32, 16:32] = 0  # one zero 16 x 16 tile
    out["zero_blocks"] = x
    x = rng.standard_normal(SHAPE).astype(np.float32)
    x[0, 0] = 2000.0
    x[5] *= 1e-2  # block scales in E4M3's subnormal range (below 2**-6) ...
    x[6] *= 4e-3
    x[7] *= 1e-7  # ... and below its smallest subnormal (2**-9): a zero scale
    out["subnormal_scales"] = x
    out["tiny_amax"] = (rng.standard_normal(SHAPE) * 1e-30).astype(np.float32)
    out["subnormal_inputs"] = (rng.standard_normal(SHAPE) * 1e-40).astype(np.float32)  # float32 subnormals, -0.0
    signs = np.where(rng.random(SHAPE) < 0.5, -1.0, 1.0).astype(np.float32)
    ties = np.resize(TIES, SHAPE) * signs
    out["ties"] = ties  # block amax 6 everywhere: the tensor scale is not a power of two
    exact = ties.copy()
    exact[0, 0] = 2688.0  # tensor amax 448 * 6: every other block is scaled by exactly 1
    out["exact_ties"] = exact
    out["near_ties"] = np.where(rng.random(SHAPE) < 0.5, np.nextafter(ties, 0), np.nextafter(ties, 10 * ties))
    out["scale_ties"] = _scale_ties(rng)
    big = rng.standard_normal(SHAPE) * 1e38
    out["near_float32_max"] = np.clip(big, -3.4e38, 3.4e38).astype(np.float32)
    return out


def nonfinite_cases() -> dict[str, np.ndarray]:
    """Operands holding inf or NaN (one bad element each)."""
    rng = np.random.default_rng(20261)
    out = {}
    for name, value in (("nan", np.nan), ("inf", np.inf), ("minus_inf", -np.inf)):
        x = rng.standard_normal(SHAPE).astype(np.float32)
        x[2, 20] = value
        out[name] = x
    return out


def _scale_ties(rng: np.random.Generator) -> np.ndarray:
    """Block scales at E4M3 ties: under a tensor amax of 1000 (global encode scale ``2688 / 1000``, not a power
    of two) each block's max is within a few float32 ulps of ``6 / g_enc`` times a value halfway between two
    E4M3 values (normal or subnormal), so the rounding of each rule's float32 operations decides the scale."""
    m, k = SHAPE
    g_enc = np.float32(2688.0) / np.float32(1000.0)
    x = rng.uniform(-1, 1, SHAPE).astype(np.float32)
    for r in range(m):
        for b in range(k // 16):
            e = int(rng.integers(-9, 8))
            odd = 2 * int(rng.integers(0, 8)) + 1
            mid = odd * 2.0**-10 if e < -6 else 2.0**e * (1 + odd / 16)
            bmax = np.float32(mid * 6 / float(g_enc))
            for _ in range(abs(step := int(rng.integers(-3, 4)))):
                bmax = np.nextafter(bmax, np.float32(np.inf if step > 0 else 0))
            block = x[r, 16 * b: 16 * b + 16] * bmax
            block[int(rng.integers(0, 16))] = bmax * (1 if rng.random() < 0.5 else -1)
            x[r, 16 * b: 16 * b + 16] = block
    x[0, 0] = 1000.0
    return x


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even) and back."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)
