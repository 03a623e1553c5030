"""pytest plugin (load with `-p dropin_fabric`): substitute lightning_ext's Fabric plugin for Lightning Fabric's.

Loaded before collection, so `from lightning.fabric.plugins.precision.amp import MixedPrecision` in the test
modules binds ours; the connector's module-level name is patched too, so `Fabric(precision="16-mixed"/
"bf16-mixed")` constructs ours (`_Connector._check_and_init_precision`), also in ddp_spawn children (they
unpickle the instance: this folder's parent must be on their PYTHONPATH, which they inherit).
"""

import lightning.fabric.connector as _conn
import lightning.fabric.plugins as _plugins
import lightning.fabric.plugins.precision as _precision
import lightning.fabric.plugins.precision.amp as _amp

from lightning_ext.fabric import MixedPrecision as _Ours

_NATIVE = _amp.MixedPrecision
for _mod in (_plugins, _precision, _amp, _conn):
    assert _mod.MixedPrecision is _NATIVE, _mod.__name__
    _mod.MixedPrecision = _Ours


def pytest_report_header(config):
    return f"dropin: lightning.fabric MixedPrecision -> {_Ours.__module__}.{_Ours.__qualname__}"
