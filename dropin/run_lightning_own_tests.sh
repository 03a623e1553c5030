#!/usr/bin/env bash
# Lightning's own tests of its MixedPrecision plugin, (a) against native Lightning and (b) with
# lightning_ext.MixedPrecision substituted (the pytest plugin dropin_lightning.py in this folder).
#
# Lightning's tests are not in its wheel: point LIGHTNING_TESTS at the tests/ folder of a checkout of the
# installed version's tag, e.g.
#   git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
#   LIGHTNING_TESTS=/tmp/pl/tests dropin/run_lightning_own_tests.sh [native|dropin|both] [pytest args]
# Expected with ours (2.6.5 tests, lightning 2.6.6, CPU): 15 passed, 8 skipped (GPU), as native. The two tests
# that hand the plugin a Mock() as its scaler go through lightning_ext/external_scaler.py.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$HERE/.." && pwd)
PY=${PY:-$MAIN/.venv/bin/python}
: "${LIGHTNING_TESTS:?set LIGHTNING_TESTS to the tests/ folder of a Lightning checkout (see the header)}"
MODE=${1:-both}; shift || true
TESTS=(tests_pytorch/plugins/test_amp_plugins.py tests_pytorch/plugins/precision/test_amp.py tests_pytorch/models/test_amp.py)
# TensorFlow and jax (installed for Keras) set these on first import; Lightning's restore_env_variables
# fixture would report that as a leak of whichever test imports them first: preset them.
export PYTHONDONTWRITEBYTECODE=1 HDF5_PLUGIN_PATH=disable TF_CPP_MIN_LOG_LEVEL=2 TPU_SKIP_MDS_QUERY=1
cd "$LIGHTNING_TESTS"
rc=0
if [[ $MODE == native || $MODE == both ]]; then
  echo "===== (a) native Lightning MixedPrecision"
  PYTHONPATH="$LIGHTNING_TESTS" "$PY" -m pytest -p no:cacheprovider -v -rfEsxX --tb=short "${TESTS[@]}" "$@" || rc=$?
fi
if [[ $MODE == dropin || $MODE == both ]]; then
  echo "===== (b) lightning_ext.MixedPrecision substituted"
  PYTHONPATH="$HERE:$MAIN:$LIGHTNING_TESTS" "$PY" -m pytest -p no:cacheprovider -p dropin_lightning -v -rfEsxX \
    --tb=short "${TESTS[@]}" "$@" || rc=$?
fi
exit $rc
