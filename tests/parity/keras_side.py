"""Run the Keras side of parity cases in a fresh process and write the trajectories as JSON.

Used by ``test_parity_torch_backend.py`` with ``KERAS_BACKEND=torch`` (the backend is
fixed when keras is imported, so it cannot change inside the pytest process)::

    KERAS_BACKEND=torch python -m tests.parity.keras_side OUT.json CASE_ID [CASE_ID ...]

A case id is ``recipe:optimizer:kind``; the rest of the case is the suite's default.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import keras

    from tests.parity import runs

    out, ids = argv[0], argv[1:]
    results = {"backend": keras.backend.backend(), "runs": {}}
    for case_id in ids:
        recipe, optimizer, kind = case_id.split(":")
        case = runs.Case(recipe, optimizer, kind, hidden=runs.HIDDEN[kind])
        results["runs"][case_id] = runs.trajectory_to_json(runs.run_keras(case))
    with open(out, "w") as fh:
        json.dump(results, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
