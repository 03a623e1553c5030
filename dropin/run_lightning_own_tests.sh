#!/usr/bin/env bash
# Lightning's own tests of its MixedPrecision plugins, (a) against native Lightning and (b) with lightning_ext's
# substituted: the Trainer plugin (lightning_ext.MixedPrecision, pytest plugin dropin_lightning.py in this folder)
# and the Fabric plugin (lightning_ext.fabric.MixedPrecision, dropin_fabric.py).
#
# Lightning's tests are not in its wheel: point LIGHTNING_TESTS at the tests/ folder of a checkout of the
# installed version's tag, e.g.
#   git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
#   LIGHTNING_TESTS=/tmp/pl/tests [SUITE=trainer|fabric|all] dropin/run_lightning_own_tests.sh [native|dropin|both] [pytest args]
# SUITE (default trainer): trainer = tests_pytorch's three AMP files; fabric = tests_fabric/plugins/precision/
# test_amp.py + test_amp_integration.py; all = both suites.
# Expected (2.6.5 tests, lightning 2.6.6, CPU), ours as native:
#   trainer: 15 passed, 8 skipped (GPU). The two tests that hand the plugin a Mock() as its scaler go through
#            lightning_ext/external_scaler.py.
#   fabric:  9 passed, 3 skipped (GPU). test_amp[cpu-*] runs ours in 2 ddp_spawn processes (the connector builds
#            ours for precision="16-mixed"/"bf16-mixed"; 16-mixed becomes bf16-mixed on CPU, as native).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$HERE/.." && pwd)
PY=${PY:-$MAIN/.venv/bin/python}
: "${LIGHTNING_TESTS:?set LIGHTNING_TESTS to the tests/ folder of a Lightning checkout (see the header)}"
MODE=${1:-both}; shift || true
SUITE=${SUITE:-trainer}
TRAINER_TESTS=(tests_pytorch/plugins/test_amp_plugins.py tests_pytorch/plugins/precision/test_amp.py
               tests_pytorch/models/test_amp.py)
FABRIC_TESTS=(tests_fabric/plugins/precision/test_amp.py tests_fabric/plugins/precision/test_amp_integration.py)
# TensorFlow and jax (installed for Keras) set these on first import; Lightning's restore_env_variables
# fixture would report that as a leak of whichever test imports them first: preset them.
export PYTHONDONTWRITEBYTECODE=1 HDF5_PLUGIN_PATH=disable TF_CPP_MIN_LOG_LEVEL=2 TPU_SKIP_MDS_QUERY=1
cd "$LIGHTNING_TESTS"
rc=0
run() {  # run <label> <dropin plugin or ""> <tests...>
  local label=$1 plugin=$2; shift 2
  echo "===== $label"
  if [[ -z $plugin ]]; then
    PYTHONPATH="$LIGHTNING_TESTS" "$PY" -m pytest -p no:cacheprovider -v -rfEsxX --tb=short "$@" "${ARGS[@]}" || rc=$?
  else
    PYTHONPATH="$HERE:$MAIN:$LIGHTNING_TESTS" "$PY" -m pytest -p no:cacheprovider -p "$plugin" -v -rfEsxX \
      --tb=short "$@" "${ARGS[@]}" || rc=$?
  fi
}
ARGS=("$@")
for suite in trainer fabric; do
  [[ $SUITE == "$suite" || $SUITE == all ]] || continue
  if [[ $suite == trainer ]]; then tests=("${TRAINER_TESTS[@]}"); plugin=dropin_lightning; what="lightning_ext.MixedPrecision"
  else tests=("${FABRIC_TESTS[@]}"); plugin=dropin_fabric; what="lightning_ext.fabric.MixedPrecision"; fi
  [[ $MODE == native || $MODE == both ]] && run "(a) $suite: native Lightning MixedPrecision" "" "${tests[@]}"
  [[ $MODE == dropin || $MODE == both ]] && run "(b) $suite: $what substituted" "$plugin" "${tests[@]}"
done
exit $rc
