"""How many bytes per parameter does each recipe hold at the optimizer step, and does the estimate say so?

    python benchmarks/memory.py [--frameworks lightning keras] [--recipes RECIPE_OR_LABEL ...] [--steps 3]
        [--hidden 256] [--depth 2] [--batch-size 32] [--json PATH]

Per recipe (or recipe label: ``bf16-master[state_dtype=8bit]``, ``bf16-master[master_remainders]``,
``bf16-sr[state_dtype=bfloat16]``...), the ``mpx compare`` runners train their MLP on scikit-learn's digits with
AdamW for ``--steps`` steps (``mp_callbacks.app.lightning_runner.run``: ``Trainer`` + ``lightning_ext.MixedPrecision``;
``mp_callbacks.app.keras_runner.run``: ``model.fit`` + ``keras_ext``), and report the model state held at the
optimizer step, measured (Lightning: every distinct storage of the weights, gradients, FP32 masters, optimizer
states and compensation buffers, at the step's start and end, the larger; Keras: the variables, masters and slots
held, plus one gradient per trainable variable in the dtype the step holds it), next to
``mp_callbacks.estimate_memory`` for the dtypes the parameters ended in.  The output layer stays FP32 by policy, so
a figure is a little above the recipe's nominal one.  Exact counts, not timings (the CPU line is printed anyway).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

RECIPES = ("32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master", "bf16-master[master_remainders]",
           "bf16-master[state_dtype=8bit]", "bf16-kahan", "bf16-kahan[state_dtype=bfloat16]", "bf16-sr",
           "bf16-sr[state_dtype=bfloat16]", "fp8-mixed")


def measure(framework: str, recipe: str, args: argparse.Namespace) -> dict:
    """One run of the app's runner: its measured and estimated bytes per parameter (or the error)."""
    from mp_callbacks.app.compare import RunSpec

    spec = RunSpec(steps=args.steps, batch_size=args.batch_size, hidden=args.hidden, depth=args.depth, threads=1)
    try:
        if framework == "lightning":
            from mp_callbacks.app.lightning_runner import run
        else:
            from mp_callbacks.app.keras_runner import run
        result = run(recipe, spec)
    except Exception as exc:  # noqa: BLE001 - a recipe a framework does not train: said in its row
        return {"framework": framework, "recipe": recipe, "error": f"{type(exc).__name__}: {exc}"[:300]}
    held, est = result.state_bytes_per_param, result.estimate_bytes_per_param
    return {"framework": framework, "recipe": recipe, "params": result.params, "held_bytes_per_param": held,
            "estimate_bytes_per_param": est, "held_over_estimate": None if held is None else held / est}


def markdown(rows: list[dict]) -> str:
    lines = ["| framework | recipe | params | held B/param | estimate B/param | held / estimate |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['framework']} | {r['recipe']} | - | not run: {r['error']} | - | - |")
            continue
        held = "-" if r["held_bytes_per_param"] is None else f"{r['held_bytes_per_param']:.2f}"
        ratio = "-" if r["held_over_estimate"] is None else f"{r['held_over_estimate']:.3f}"
        lines.append(f"| {r['framework']} | {r['recipe']} | {r['params']:,} | {held} | "
                     f"{r['estimate_bytes_per_param']:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", nargs="+", choices=["lightning", "keras"], default=["lightning", "keras"])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), metavar="RECIPE_OR_LABEL")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    harness.quiet()
    rows = [measure(f, r, args) for f in args.frameworks for r in args.recipes]
    print(harness.machine_line(1))
    print(f"Model state at the optimizer step: the mpx compare MLP 64-{'-'.join([str(args.hidden)] * args.depth)}-10, "
          f"AdamW, {args.steps} steps of batch {args.batch_size}\n")
    print(markdown(rows))
    harness.write_json(args.json, rows, 1)
    return rows


if __name__ == "__main__":
    main()
