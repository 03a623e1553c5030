"""The framework-neutral helpers both monitors share: expected scaler series, series extraction, storage rule."""

from mp_callbacks import ScalerConfig, get_recipe
from mp_callbacks.diagnostics import swamp_storage_dtype
from tests.helpers.series import expected_series, read_csv_series, series_from_rows


def test_expected_series_follows_the_scaler():
    config = ScalerConfig(init_scale=8.0, growth_interval=2)
    got = expected_series(config, [False, True, False, False, True])
    assert got["mp/scale"] == [8.0, 8.0, 4.0, 4.0, 8.0]  # the scale each step used
    assert got["mp/overflow"] == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert got["mp/overflows_total"] == [0.0, 1.0, 1.0, 1.0, 2.0]  # totals after each step
    assert got["mp/skipped_total"] == got["mp/overflows_total"]
    assert got["mp/growths_total"] == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_series_from_rows_and_csv(tmp_path):
    rows = [{"step": "2", "mp/scale": "4.0"}, {"step": "0", "other": "1"}, {"step": "1", "mp/scale": "8.0"}]
    assert series_from_rows(rows, ["mp/scale"]) == {"mp/scale": [8.0, 4.0]}
    path = tmp_path / "m.csv"
    path.write_text("mp/scale,other,step\n,1,0\n8.0,,1\n4.0,,2\n")
    assert read_csv_series(path, ["mp/scale"]) == {"mp/scale": [8.0, 4.0]}


def test_swamp_storage_dtype():
    assert swamp_storage_dtype(get_recipe("bf16-master"), "bfloat16", False) == "bfloat16"
    assert swamp_storage_dtype(get_recipe("bf16-master"), "float32", True) == "float32"
    assert swamp_storage_dtype(get_recipe("16-mixed"), "float32", False) == "float16"
    assert swamp_storage_dtype(get_recipe("16-mixed"), "float32", True) == "float32"
    assert swamp_storage_dtype(get_recipe("32-true"), "float32", False) == "float32"
