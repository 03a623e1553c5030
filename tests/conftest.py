"""Suite-wide settings: tests marked ``multiprocess`` share one xdist worker.

`make test` runs the suite on two xdist workers (``-n 2 --dist loadgroup``).  Tests that launch
processes of their own (ddp_spawn, torchrun, TF multi-worker) bind local ports and use every core,
so they run one after another on the same worker instead of beside each other.
"""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
