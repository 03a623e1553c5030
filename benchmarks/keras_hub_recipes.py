"""keras_hub backbones under every recipe: the low-precision share and the loss against Keras' own policies.

    python benchmarks/keras_hub_recipes.py [--families gpt2 bert llama gemma] [--steps 2]

Each family is a backbone built from its config (tiny, random init, nothing downloaded) with an LM head
(``tests/keras/helpers/keras_hub_models.py``: all families side by side in one model, one loss each).
Per recipe: keras_ext (``set_global_policy`` + ``apply_policy`` + ``master_optimizer(AdamW)``) and Keras'
own policy (``float32`` for 32-true, ``mixed_float16`` + Keras' ``LossScaleOptimizer`` for ``16-*``,
``mixed_bfloat16`` otherwise) train the same steps from the same initial weights (every recipe draws them
in FP32); the table prints, per family, the share of the backbone's Dense/EinsumDense kernel parameters
that compute in low precision (``keras_ext.low_precision_share``) and the loss on the batch after training.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["gpt2", "bert", "llama", "gemma"])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    import keras_ext
    from mp_callbacks.recipes import RECIPE_NAMES
    from tests.keras.helpers import keras_hub_models as hub

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import machine_line

    families = tuple(args.families)
    print(machine_line())
    natives = {}
    print(f"{'family':<7} {'recipe':<12} {'share ours':>10} {'native':>7} {'loss ours':>10} {'native':>10} "
          f"{'32-true':>10} {'rel. diff':>9}")
    for recipe in RECIPE_NAMES:
        model, loss = hub.train(recipe, steps=args.steps, families=families)
        native = hub.native_of(recipe)
        if native not in natives:
            natives[native] = hub.train(native, steps=args.steps, families=families)
        if "native:float32" not in natives:
            natives["native:float32"] = hub.train("native:float32", steps=args.steps, families=families)
        theirs, their_loss = natives[native]
        fp32_loss = natives["native:float32"][1]
        ours_bb, their_bb = hub.backbones(model), hub.backbones(theirs)
        for family in families:
            share = keras_ext.low_precision_share(ours_bb[family])
            native_share = keras_ext.low_precision_share(their_bb[family])
            rel = (loss[family] - their_loss[family]) / their_loss[family]
            print(f"{family:<7} {recipe:<12} {share:>10.3f} {native_share:>7.3f} {loss[family]:>10.5f} "
                  f"{their_loss[family]:>10.5f} {fp32_loss[family]:>10.5f} {rel:>+9.1e}", flush=True)


if __name__ == "__main__":
    main()
