"""Run the Keras side of parity cases in a fresh process and write the trajectories as plain arrays.

Used by ``test_parity_torch_backend.py`` with ``KERAS_BACKEND=torch`` (the backend is
fixed when keras is imported, so it cannot change inside the pytest process)::

    KERAS_BACKEND=torch python -m tests.parity.keras_side OUT.npz CASE_ID [CASE_ID ...]

A case id is ``recipe:optimizer:kind``; the rest of the case is the suite's default.  The id
``fp8`` runs the Keras side of ``test_fp8_parity.py`` (its arrays under ``fp8/``).
OUT.npz holds ``backend`` and, per case, :func:`runs.trajectory_arrays` under
``CASE_ID/`` (``np.load(OUT, allow_pickle=False)`` reads it back).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import keras
    import numpy as np

    from tests.parity import runs

    out, ids = argv[0], argv[1:]
    arrays = {"backend": np.asarray(keras.backend.backend())}
    for case_id in ids:
        if case_id == "fp8":
            from tests.parity import test_fp8_parity

            arrays.update({f"fp8/{k}": v for k, v in test_fp8_parity.run_keras().items()})
            continue
        recipe, optimizer, kind = case_id.split(":")
        case = runs.Case(recipe, optimizer, kind, hidden=runs.HIDDEN[kind])
        arrays.update(runs.trajectory_arrays(runs.run_keras(case), prefix=f"{case_id}/"))
    np.savez(out, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
