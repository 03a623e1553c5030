"""FP8 all-gather's rule (``mp_callbacks.fp8.allgather``): the setting, the sharded cast and the bytes.

References: the NumPy cast of the whole weight (``fp8_round`` with the scale of its amax) and the byte
count by hand; the two-process run against torchao is ``tests/lightning/test_fp8_allgather.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from mp_callbacks.fp8 import E4M3, FP8ConfigError, FP8Recipe, FP8State, fp8_round, sharded_fp8_cast
from mp_callbacks.memory import fsdp_step_bytes

CURRENT = {"preset": "torchao"}
DELAYED = {"history_len": 4}


def test_the_setting_is_validated_and_round_trips():
    recipe = FP8Recipe.coerce({"preset": "torchao", "fsdp_float8_all_gather": True})
    assert recipe.fsdp_float8_all_gather and FP8Recipe.from_dict(recipe.to_dict()) == recipe
    assert "fsdp_float8_all_gather" not in FP8Recipe().to_dict()  # the default's record is unchanged
    with pytest.raises(FP8ConfigError, match=r"\(granularity 'tensorwise'\), not 'rowwise'"):
        FP8Recipe.coerce({"granularity": "rowwise", "fsdp_float8_all_gather": True})
    with pytest.raises(FP8ConfigError, match="must be True or False"):
        FP8Recipe.coerce({"fsdp_float8_all_gather": "yes"})


def test_the_sharded_cast_reference_is_the_cast_of_the_whole_weight():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((15, 8)) * 3).astype(np.float32)
    for settings in (CURRENT, DELAYED):
        config = FP8Recipe.coerce(settings).config("weights")
        state = FP8State(np.zeros(config.history_len, np.float32), np.float32(0.37), np.float32(1 / np.float32(0.37)),
                         np.int32(0), np.int32(0))
        q, scale, _ = sharded_fp8_cast([w[:8], w[8:]], config, state)
        whole, scale1, _ = sharded_fp8_cast([w], config, state)
        assert scale == scale1 and np.array_equal(np.concatenate(q), whole[0])
        assert (scale == np.float32(0.37)) == (config.mode == "delayed")
        if config.mode == "current":  # the cast of the whole weight with the scale of its amax
            scale = np.float32(np.float64(E4M3.max) / np.abs(w).max())
            assert scale == scale1 and np.array_equal(whole[0], fp8_round(w * scale, E4M3))


def test_fp8_gathered_weights_count_one_byte_in_one_uint8_buffer_per_unit():
    unit = ([(15, 8), (15,)], ["float8_e4m3fn", "bfloat16"], "float32", 2)  # rows padded to 16 for 2 shards
    got = fsdp_step_bytes([unit], 2)
    assert got["all_gather"] == {"uint8": 2 * (16 * 8 * 1 + 16 * 2)}
    assert got["reduce_scatter"] == {"float32": (16 * 8 + 16) * 4}
    assert fsdp_step_bytes([([(16, 8)], ["e4m3"], "float32", 1)], 2)["all_gather"] == {"uint8": 128}
    assert fsdp_step_bytes([([(16, 8)], "bfloat16", "float32", 1)], 2)["all_gather"] == {"bfloat16": 256}
    with pytest.raises(ValueError, match="2 gather dtypes for 1 parameters"):
        fsdp_step_bytes([([(16, 8)], ["e4m3", "bf16"], "float32", 1)], 2)
