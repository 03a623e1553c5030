"""``python -m mp_callbacks presets``: the preset trajectories and the recipes table obey the rules they
print, and bad flags get a clear message."""

import math
import re
import subprocess
import sys

import pytest

from mp_callbacks import ScalerConfig
from mp_callbacks.loss_scale import PRESETS
from mp_callbacks.recipes import RECIPE_NAMES

# One xdist worker runs this module, so its module-scoped runs happen once under --dist loadgroup.
pytestmark = pytest.mark.xdist_group("presets_cli")

STEPS, INTERVAL = 400, 20


def _run(*args):
    return subprocess.run([sys.executable, "-m", "mp_callbacks", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def output():
    out = _run("presets", "--steps", str(STEPS), "--growth-interval", str(INTERVAL))
    assert out.returncode == 0, out.stderr
    return out.stdout


def _rows(text: str, names) -> dict:
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in names and parts[0] not in rows:
            rows[parts[0]] = parts
    return rows


def test_every_preset_skips_every_overflow_within_its_bounds(output):
    injected = int(re.search(rf"over {STEPS} steps, (\d+) injected overflows", output).group(1))
    assert injected >= 8  # the pattern holds a burst of 8 overflows in the middle
    rows = _rows(output, PRESETS)
    assert list(rows) == list(PRESETS)
    log2 = {}
    for name, parts in rows.items():
        config = ScalerConfig.preset(name)
        init, final, low, high = (int(p.removeprefix("2^")) for p in parts[1:5])
        skipped, growths = int(parts[5]), int(parts[6])
        assert skipped == injected, name  # every overflow is skipped, by every preset
        assert init == math.log2(config.init_scale), name
        assert low <= min(init, final) and max(init, final) <= high, name
        assert math.log2(config.min_scale) <= low and high <= math.log2(config.max_scale), name
        assert 0 < growths <= STEPS // INTERVAL, name  # at most one growth per interval of clean steps
        log2[name] = (init, final, high)
    # apex caps at 2**24 and reaches it; the others have no binding cap here
    assert log2["apex"][2] == 24
    # presets sharing a rule (factor 2, backoff 1/2, no binding floor or cap) move alike from their init
    same_rule = [log2[n][1] - log2[n][0] for n in ("torch", "keras", "tf-keras", "jmp")]
    assert len(set(same_rule)) == 1
    assert log2["megatron"][1] - log2["megatron"][0] == log2["deepspeed"][1] - log2["deepspeed"][0]
    # hysteresis 2 (megatron, deepspeed) backs off less on the same pattern than hysteresis 1 (torch)
    assert log2["megatron"][1] - log2["megatron"][0] > same_rule[0]


# The recipes of the source documents, their columns written out by hand: params, compute,
# FP32 masters, loss scaling, AdamW bytes/param (4 weight + 4 grad + 8 for m, v with FP32 params;
# 2 + 2 + 4 master + 8 with masters).
KNOWN = {
    "32-true": ("float32", "float32", "False", "off", 4 + 4 + 8),
    "16-mixed": ("float32", "float16", "False", "dynamic", 4 + 4 + 8),
    "bf16-mixed": ("float32", "bfloat16", "False", "off", 4 + 4 + 8),
    "16-master": ("float16", "float16", "True", "dynamic", 2 + 2 + 4 + 8),
    "bf16-master": ("bfloat16", "bfloat16", "True", "off", 2 + 2 + 4 + 8),
}


def test_recipes_table(output):
    rows = _rows(output.split("Recipes")[1], RECIPE_NAMES)
    assert list(rows) == list(RECIPE_NAMES)  # every recipe is listed, in order
    for name, want in KNOWN.items():
        _, params, compute, masters, scaling, per_param = rows[name]
        assert (params, compute, masters, scaling, int(per_param)) == want, name


def test_bad_flags_are_named():
    out = _run("presets", "--rate", "2")
    assert out.returncode == 2 and "--rate: 2.0 must be in [0, 1]" in out.stderr
    out = _run("nonsense")
    assert out.returncode == 2 and "invalid choice" in out.stderr
