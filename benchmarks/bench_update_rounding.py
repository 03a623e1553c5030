"""Lightning and Keras: bf16-kahan and bf16-sr (no FP32 masters) against bf16-master, per step.

    python benchmarks/bench_update_rounding.py [--threads 1 2] [--rounds 7] [--steps 30] [--batch-size 16]
                                               [--hidden 1024] [--optimizer adamw] [--frameworks lightning keras]
                                               [--keras-step | --keras-update] [--keras-jit] [--keras-previous]

The default batch is small (16) so that the optimizer step, where the
recipes differ, is a large share of the step (the recipes' worst case; with
larger batches the forward/backward dilutes the difference).  Trains the
same MLP on the same digits batches with AdamW (or SGD with
momentum 0.9) under ``lightning_ext.MixedPrecision("bf16-master")``,
``("bf16-kahan")`` and ``("bf16-sr")``, alternating in one process (order
reversed every other round), and prints, in wall and in CPU time, the step
times (a fit's figure: its median timed window, ``common.fit_figures``) and the
median per-round ratios kahan / master and sr / master, with the control ratio of
bf16-master against a second copy of itself (the machine's noise), the CPU
model and the model-state bytes per parameter each variant holds at the
optimizer step (the estimator's figure beside it).  Keras (``keras_ext.master_optimizer``
around Keras' AdamW / SGD, ``model.fit`` on the TensorFlow backend unless
KERAS_BACKEND says otherwise) runs the same three side by side in the same
process, after Lightning, with the first ``--threads`` value only (TensorFlow
fixes its thread pools when it starts); its bytes per parameter are the
variables held plus one gradient per variable (``mp_callbacks.app.keras_runner.state_bytes``).
Keras flags: ``--keras-step`` (the default) times ``model.fit``'s whole train step, ``--keras-update``
the optimizer's update alone (TensorFlow: a ``tf.function`` of ``opt.apply`` with fixed bf16 gradients,
traced before timing); ``--keras-jit`` compiles either with XLA (``jit_compile=True``); ``--keras-previous``
adds ``bf16-kahan``/``bf16-sr`` with ``keras_ext.rounding_step.WHOLE_STEP`` off (each variable's rule its own
XLA kernel, the inner optimizer in the step's graph: the path before the whole-step fusion) to the same
alternation.  No thresholds: figures only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    alternate,
    base_parser,
    fit_figures,
    machine_line,
    per_step,
    print_tables,
    thread_specs,
    with_controls,
    write_json,
)

from lightning_ext import MixedPrecision  # noqa: E402
from mp_callbacks.app.compare import RunSpec  # noqa: E402
from mp_callbacks.app.lightning_runner import fit_once  # noqa: E402
from mp_callbacks.memory import estimate_memory  # noqa: E402

RECIPES = ("bf16-master", "bf16-kahan", "bf16-sr")


def optimizer_factory(name: str):
    if name == "adamw":
        return lambda params, lr: torch.optim.AdamW(params, lr=lr)
    return lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)


def measure(recipe: str, spec: RunSpec, optimizer, optimizer_name: str, held: dict[str, tuple[float, float]]):
    """One Lightning run of ``recipe`` -> (wall, CPU) seconds per step; records (held, estimated) bytes/param."""
    def once() -> tuple[float, float]:
        plugin = MixedPrecision(recipe, "cpu")
        module, recorder = fit_once(plugin, spec, optimizer=optimizer)
        n = sum(p.numel() for p in module.parameters())
        held[recipe] = (recorder.state_bytes / n, estimate(recipe, spec, optimizer_name))
        return fit_figures(recorder.times, recorder.cpu_times)  # median timed window: wall, CPU time
    return once


def estimate(recipe: str, spec: RunSpec, optimizer_name: str) -> float:
    from mp_callbacks.app.lightning_runner import mlp

    storage = [(p.numel(), "bfloat16") for p in mlp(spec.hidden, spec.depth).parameters()]
    kind = "adamw" if optimizer_name == "adamw" else "sgd-momentum"
    plugin = MixedPrecision(recipe)
    return estimate_memory(plugin.recipe.master, kind, storage, fp32_master_grads=True,
                           weights_released=plugin.free_weights_during_step).bytes_per_param


def keras_measure(recipe: str, spec: RunSpec, optimizer_name: str, held: dict[str, tuple[float, float]],
                  part: str = "step", jit: bool = False, whole_step: bool = True):
    """One Keras run of ``recipe`` -> (wall, CPU) seconds per step (``part``: ``step``, ``model.fit``'s train
    step; ``update``, the optimizer's update alone); records (held, estimated) bytes per parameter.
    ``whole_step``: :data:`keras_ext.rounding_step.WHOLE_STEP` for this run."""
    import keras

    from keras_ext import master_optimizer, rounding_step
    from mp_callbacks.app.keras_runner import fit_once, state_bytes
    from mp_callbacks.recipes import get_recipe

    def wrap(inner: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
        if optimizer_name != "adamw":
            inner = keras.optimizers.SGD(learning_rate=spec.lr, momentum=0.9)
        return master_optimizer(inner, recipe)

    def record_held(model: keras.Model, opt: keras.optimizers.Optimizer) -> None:
        tvs = model.trainable_variables
        storage = [(int(np.prod(v.shape)), keras.backend.standardize_dtype(v.dtype)) for v in tvs]
        n = sum(size for size, _ in storage)
        kind = "adamw" if optimizer_name == "adamw" else "sgd-momentum"
        est = estimate_memory(get_recipe(recipe).master, kind, storage,
                              fp32_master_grads=bool(getattr(opt, "fp32_master_grads", True))).bytes_per_param
        held[recipe] = (state_bytes(model, opt) / n, est)

    def once() -> tuple[float, float]:
        before, rounding_step.WHOLE_STEP = rounding_step.WHOLE_STEP, whole_step
        try:
            if part == "update":
                return keras_update(recipe, spec, wrap, jit, record_held)
            model, opt, recorder = fit_once(recipe, spec, optimizer=wrap, record=False, jit_compile=jit)
            record_held(model, opt)
            return fit_figures(recorder.times, recorder.cpu_times)
        finally:
            rounding_step.WHOLE_STEP = before
    return once


def keras_update(recipe: str, spec: RunSpec, wrap, jit: bool, record_held) -> tuple[float, float]:
    """The optimizer's update alone (TensorFlow): ``opt.apply`` of fixed bf16 gradients in a ``tf.function``
    (XLA with ``jit``), traced and run once before ``spec.steps`` timed steps -> (wall, CPU) s per step."""
    import keras
    import tensorflow as tf

    from keras_ext import apply_policy, set_global_policy
    from mp_callbacks.app.keras_runner import mlp, set_threads
    from mp_callbacks.recipes import get_recipe

    set_threads(spec.threads)
    policy = keras.config.dtype_policy()
    try:
        keras.utils.set_random_seed(spec.seed)
        keras.config.set_dtype_policy("float32")
        model = mlp(spec.hidden, spec.depth)
        set_global_policy(get_recipe(recipe))
        model = apply_policy(model)
    finally:
        keras.config.set_dtype_policy(policy)
    opt = wrap(keras.optimizers.AdamW(learning_rate=spec.lr))
    tvs = model.trainable_variables
    opt.build(tvs)
    r = np.random.default_rng(spec.seed)
    grads = [tf.cast(tf.constant(r.standard_normal(v.shape).astype(np.float32) * 1e-3), v.dtype) for v in tvs]
    step = tf.function(lambda g: opt.apply(g, tvs), jit_compile=jit, autograph=False)  # gradients as arguments
    step(grads)
    record_held(model, opt)
    return per_step(lambda: step(grads), spec.steps)()


def section(title: str, prefix: str, variants: dict, rounds: int, held: dict[str, tuple[float, float]],
            note: str, extra: list[tuple[str, str, str]] = ()) -> dict:
    """Alternate ``{prefix} <recipe>`` (and a control of bf16-master), print both clocks' tables and the bytes held;
    ``extra``: more (variant, native, target) ratios to print."""
    times = alternate(with_controls(variants, [f"{prefix} bf16-master"]), rounds)
    data = print_tables(title, times, [(f"{prefix} {r}", f"{prefix} bf16-master", "none (measured)")
                                       for r in RECIPES if r != "bf16-master"] + list(extra))
    for recipe, (got, est) in held.items():
        print(f"  {recipe:<12} model state at the optimizer step: {got:.2f} B/param (estimate {est:.2f}; {note})")
    return {"clocks": data, "held_estimated_bytes_per_param": held}


def keras_section(args, threads: int, spec: RunSpec) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    print(machine_line(threads))
    held: dict[str, tuple[float, float]] = {}
    part = "update" if args.keras_update else "step"
    if part == "update" and keras.backend.backend() != "tensorflow":
        raise SystemExit("--keras-update times a tf.function of opt.apply: TensorFlow backend only")
    variants = {f"keras {r}": keras_measure(r, spec, args.optimizer, held, part, args.keras_jit) for r in RECIPES}
    previous = [f"keras {r} (previous)" for r in RECIPES[1:]] if args.keras_previous else []
    for name, r in zip(previous, RECIPES[1:]):
        variants[name] = keras_measure(r, spec, args.optimizer, {}, part, args.keras_jit, whole_step=False)
    what = "the optimizer update alone" if part == "update" else "model.fit's train step"
    title = (f"Keras ({keras.backend.backend()} backend, keras {keras.__version__}), MLP {args.depth}x{args.hidden}, "
             f"batch {args.batch_size}, {threads} thread(s), {args.optimizer}, {what}, "
             f"jit_compile={bool(args.keras_jit)}")
    return section(title, "keras", variants, args.rounds, held, "the output layer is FP32 by policy",
                   extra=[(name, "keras bf16-master", "none (measured)") for name in previous])


def main() -> None:
    parser = base_parser(__doc__, rounds=7, steps=30, batch_size=16)
    parser.add_argument("--optimizer", choices=["adamw", "sgd-momentum"], default="adamw")
    parser.add_argument("--frameworks", nargs="+", choices=["lightning", "keras"], default=["lightning", "keras"])
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--keras-step", action="store_true", help="Keras: time model.fit's train step (default)")
    part.add_argument("--keras-update", action="store_true", help="Keras: time the optimizer's update alone")
    parser.add_argument("--keras-jit", action="store_true", help="Keras: compile with XLA (jit_compile=True)")
    parser.add_argument("--keras-previous", action="store_true",
                        help="Keras: also bf16-kahan/bf16-sr with keras_ext.rounding_step.WHOLE_STEP off")
    args = parser.parse_args()
    optimizer = optimizer_factory(args.optimizer)
    summaries = []
    for threads, spec in thread_specs(args):
        if "lightning" not in args.frameworks:
            continue
        torch.set_num_threads(threads)
        print(machine_line(threads))
        held: dict[str, tuple[float, float]] = {}
        variants = {f"ours {r}": measure(r, spec, optimizer, args.optimizer, held) for r in RECIPES}
        title = (f"Lightning, MLP {args.depth}x{args.hidden}, batch {args.batch_size}, {threads} thread(s), "
                 f"{args.optimizer} (CPU default implementation)")
        summaries.append(section(title, "ours", variants, args.rounds, held, "every layer bf16 here"))
    if "keras" in args.frameworks:
        threads, spec = next(iter(thread_specs(args)))
        if len(args.threads) > 1:
            print(f"\nKeras: {threads} thread(s) only (TensorFlow fixes its thread pools when it starts)")
        summaries.append(keras_section(args, threads, spec))
    write_json(args.json, summaries)


if __name__ == "__main__":
    main()
