"""pytest plugin (load with `-p dropin_lightning`): substitute lightning_ext.MixedPrecision for Lightning's.

Loaded before collection, so `from lightning.pytorch.plugins import MixedPrecision` in the test modules
(and `class MyAMP(MixedPrecision)`) bind ours; the accelerator connector's module-level name is patched
too, so `Trainer(precision="16-mixed"/"bf16-mixed")` constructs ours via `_check_and_init_precision`.
"""

import lightning.pytorch.plugins as _plugins
import lightning.pytorch.plugins.precision as _precision
import lightning.pytorch.plugins.precision.amp as _amp
import lightning.pytorch.trainer.connectors.accelerator_connector as _acc

from lightning_ext import MixedPrecision as _Ours

_NATIVE = _amp.MixedPrecision
for _mod in (_plugins, _precision, _amp, _acc):
    assert _mod.MixedPrecision is _NATIVE, _mod.__name__
    _mod.MixedPrecision = _Ours


def pytest_report_header(config):
    return f"dropin: lightning MixedPrecision -> {_Ours.__module__}.{_Ours.__qualname__}"
