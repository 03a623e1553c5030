"""Keras on a small GPT-2-style transformer: every recipe, ours vs native, alternating, with controls.

    python benchmarks/bench_transformer_keras.py [--threads 1] [--rounds 6] [--steps 120] [--batch-size 4]
        [--seq 32] [--d-model 128] [--layers 2] [--model tiny|keras_hub] [--by-fit] [--only TEXT ...]
        [--profile] [--attribute RECIPE] [--json PATH] [--no-pin]

The Keras twin of bench_transformer.py; the models are ``bench_transformer_keras_model.py``'s:
``tiny`` (default) is written out (GPT-2's blocks with a custom ``NewGELU`` layer of plain ops, which
the op policy does not know, so keras_ext runs it in FP32 unless a module rule declares it);
``--model keras_hub`` trains keras_hub's ``GPT2Backbone`` built from a config of the same size with
its tied LM head (random init, no dropout; a third-party model).  Random-token batches,
``model.fit``, AdamW lr 1e-3, ``jit_compile=False``, Grappler's remapper off for every variant
(``mp_callbacks.app.keras_runner.graph_options``).

* native: Keras' own global policy (``float32``, ``mixed_float16``,
  ``mixed_bfloat16``), AdamW, ``keras.optimizers.LossScaleOptimizer`` under
  ``mixed_float16`` (as ``model.compile`` would add it);
* ours: the model built in FP32, ``keras_ext.set_global_policy(recipe)`` +
  ``keras_ext.apply_policy``, ``keras_ext.master_optimizer(AdamW, recipe)``
  (``*-master``: bf16/fp16 variables with FP32 masters); ours bf16-mixed also
  with ``NewGELU`` declared low precision (``tiny`` only); ours bf16-master also with the whole
  FP32 gradient list widened before the update (the step before each gradient
  was widened inside its own variable's update), and with the masters' update as Keras' ops compiled by XLA
  (the step before ``keras_ext.master_native``'s one op); ours 32-true and bf16-mixed also with
  Keras' own update ops instead of that one op (the same bits), and with the inf/NaN check off
  (``scaler={"enabled": False, "skip_nonfinite": False}``, the opt-out): what the check and the skip cost.

Each native variant runs a second time as a control; the worker process is pinned to ``--threads`` CPUs
before TensorFlow starts (``common.pin_cpus``; ``--no-pin``: not).  By default the variants alternate step by step
(``lockstep.py``: every ``model.fit`` in its own thread, a Keras callback calling the clock at
``on_train_batch_begin`` / ``on_train_batch_end``, one step at a time, A B C / C B A per step; a step's
figures its wall time and the process' CPU time: TF runs its kernels on its own pool threads),
``--rounds`` windows of the steps after a tenth of
warm-up, a window's figure its median step, ratios the median of per-window ratios with their min-max;
``--by-fit`` alternates whole fits instead (``common.alternate``, ``--rounds`` fits each, a fit's figure
its median timed window).  TensorFlow's thread pools are fixed at its start, so each thread count runs
in a subprocess of this script.  ``--attribute RECIPE``: ours under RECIPE, and ours with one piece
switched off at a time (:data:`OFF`: the finite check, the divergence rule, the host read of its latch, all
but the update), against each other and native, lock-step as above.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PAIRS = [
    ("ours 32-true", "native 32-true", "<= 1.02"),
    ("ours 32-true, no inf/NaN check", "native 32-true", "the check's price (the opt-out)"),
    ("ours 32-true", "ours 32-true, generic check", "the one-op check (keras_ext.check_native) vs IsFinite+All"),
    ("ours 32-true", "ours 32-true, Keras' update", "the one-op update (keras_ext.master_native) vs Keras' ops"),
    ("ours 32-true, Keras' update", "native 32-true", "ours but the update (the same bits)"),
    ("ours 16-mixed", "native 16-mixed", "<= 1.02"),
    ("ours bf16-mixed", "native bf16-mixed", "<= 1.02"),
    ("ours bf16-mixed, no inf/NaN check", "native bf16-mixed", "the check's price (the opt-out)"),
    ("ours bf16-mixed", "ours bf16-mixed, generic check", "the one-op check vs IsFinite+All"),
    ("ours bf16-mixed", "ours bf16-mixed, Keras' update", "the one-op update vs Keras' ops"),
    ("ours bf16-mixed, Keras' update", "native bf16-mixed", "ours but the update (the same bits)"),
    ("ours bf16-mixed", "ours bf16-mixed, NewGELU declared bf16", "FP32 region of the unknown GELU layer"),
    ("ours 16-master", "native 16-mixed", "<= 0.95"),
    ("ours bf16-master", "native bf16-mixed", "<= 0.95"),
    ("ours bf16-master", "ours bf16-master, FP32 gradient list", "grads widened in their own update vs all first"),
    ("ours bf16-master", "ours bf16-master, XLA update", "the one-op update (keras_ext.master_native) vs XLA's"),
    ("ours bf16-kahan", "native bf16-mixed", "none"),
    ("ours bf16-sr", "native bf16-mixed", "none"),
]
NATIVES = ["native 32-true", "native 16-mixed", "native bf16-mixed"]


def worker(args: argparse.Namespace) -> None:
    from common import pin_cpus

    pinned = args.pinned = "" if args.no_pin else pin_cpus(args.threads)  # before TensorFlow starts its pools
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    import keras
    from bench_transformer_keras_model import build_model, token_data
    from common import alternate, fit_figures, machine_line, print_tables, with_controls
    from keras import ops
    from lockstep import StepClock, lockstep

    import keras_ext
    import keras_ext.check_native
    import keras_ext.master_native
    from mp_callbacks.app.keras_runner import graph_options
    from mp_callbacks.app.keras_runner import run as keras_run
    from mp_callbacks.recipes import get_recipe

    d, seq, vocab = args.d_model, args.seq, args.vocab

    def build() -> keras.Model:
        return build_model(args.model, vocab, seq, d, args.layers)

    xs, ys = token_data(args.model, vocab, seq, args.steps * args.batch_size)

    class Timer(keras.callbacks.Callback):
        """Per-step wall and CPU time of one fit (``--by-fit``), or the lock-step clock's begin/end."""

        def __init__(self, clock: StepClock | None = None) -> None:
            super().__init__()
            self.clock = clock
            self.times: list[float] = []
            self.cpu_times: list[float] = []

        def on_train_batch_begin(self, batch, logs=None):  # noqa: ANN001
            if self.clock is not None:
                self.clock.begin()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, batch, logs=None):  # noqa: ANN001
            ops.convert_to_numpy(logs["loss"])  # the step is done on the host
            self.times.append(time.perf_counter() - self.t0)
            self.cpu_times.append(time.process_time() - self.c0)
            if self.clock is not None:
                self.clock.end()

    def compiled(model: keras.Model, optimizer: keras.optimizers.Optimizer, clock: StepClock | None = None):
        """The model compiled (main thread); returns the fit (in lock-step: run in the variant's thread)."""
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        timer = Timer(clock)

        def train() -> Timer:
            model.fit(xs, ys, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
            return timer
        return train

    def fit(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> tuple[float, float]:
        with graph_options():
            timer = compiled(model, optimizer)()
        return fit_figures(timer.times, timer.cpu_times)

    def make_native(policy: str) -> tuple[keras.Model, keras.optimizers.Optimizer]:
        before = keras.config.dtype_policy()
        keras.utils.set_random_seed(0)
        keras.config.set_dtype_policy(policy)
        try:
            model = build()
        finally:
            keras.config.set_dtype_policy(before)
        opt = keras.optimizers.AdamW(1e-3)
        if policy == "mixed_float16":
            opt = keras.optimizers.LossScaleOptimizer(opt)
        return model, opt

    def make_ours(recipe: str, gelu_low: bool = False, fp32_list: bool = False, off: str | None = None,
                  check: bool = True, generic: bool = False, op_update: bool = True
                  ) -> tuple[keras.Model, keras.optimizers.Optimizer]:
        before = keras.config.dtype_policy()
        keras.utils.set_random_seed(0)
        keras.config.set_dtype_policy("float32")
        try:
            model = build()
            policy = get_recipe(recipe).policy
            if gelu_low:
                import dataclasses

                rules = policy.module_rules + (("NewGELU", policy.compute),)
                policy = dataclasses.replace(policy, module_rules=rules)
            keras_ext.set_global_policy(recipe)
            model = keras_ext.apply_policy(model, policy)
        finally:
            keras.config.set_dtype_policy(before)
        opt = keras_ext.master_optimizer(keras.optimizers.AdamW(1e-3), recipe,
                                         **({"divergence": False} if off == OFF[1] else {}),
                                         **({} if check else {"scaler": {"enabled": False, "skip_nonfinite": False}}))
        switch_off(opt, off)
        if fp32_list:  # the step before keras_ext widened each gradient in its own update (18 B/param)
            opt._masters.widens_in_update = lambda optimizer: False
        if not op_update:  # the update as Keras' ops (*-master: compiled by XLA), not keras_ext.master_native's op
            opt._native_update = lambda: None
        if generic:  # the check traced as IsFinite + All per gradient, not keras_ext.check_native's one op
            opt._found_inf = generic_check(opt._found_inf)
        return model, opt

    def generic_check(found_inf):  # noqa: ANN001, ANN202 - a bound method, wrapped
        def traced(grads):  # noqa: ANN001, ANN202
            import keras_ext.check_native as check_native

            check_native.NATIVE = False
            try:
                return found_inf(grads)
            finally:
                check_native.NATIVE = True
        return traced

    if args.profile:
        from keras_step_profile import profile

        profile(args, fit, make_native, make_ours)
        return

    makers = {
        "native 32-true": (make_native, ("float32",)), "ours 32-true": (make_ours, ("32-true",)),
        "native 16-mixed": (make_native, ("mixed_float16",)), "ours 16-mixed": (make_ours, ("16-mixed",)),
        "native bf16-mixed": (make_native, ("mixed_bfloat16",)), "ours bf16-mixed": (make_ours, ("bf16-mixed",)),
        "ours 16-master": (make_ours, ("16-master",)), "ours bf16-master": (make_ours, ("bf16-master",)),
        "ours bf16-master, FP32 gradient list": (make_ours, ("bf16-master", False, True)),
        "ours bf16-master, XLA update": (make_ours, ("bf16-master", False, False, None, True, False, False)),
        "ours 32-true, Keras' update": (make_ours, ("32-true", False, False, None, True, False, False)),
        "ours bf16-mixed, Keras' update": (make_ours, ("bf16-mixed", False, False, None, True, False, False)),
        "ours 32-true, no inf/NaN check": (make_ours, ("32-true", False, False, None, False)),
        "ours bf16-mixed, no inf/NaN check": (make_ours, ("bf16-mixed", False, False, None, False)),
        "ours 32-true, generic check": (make_ours, ("32-true", False, False, None, True, True)),
        "ours bf16-mixed, generic check": (make_ours, ("bf16-mixed", False, False, None, True, True)),
    }
    if args.model == "tiny":  # keras_hub's GELU is the Dense layer's activation, not a layer of its own
        makers["ours bf16-mixed, NewGELU declared bf16"] = (make_ours, ("bf16-mixed", True))
    for recipe in ("bf16-kahan", "bf16-sr"):
        if getattr(keras_run, "supports", lambda _: True)(recipe):
            makers[f"ours {recipe}"] = (make_ours, (recipe,))

    if args.attribute:  # ours with one piece switched off at a time, against ours and native
        recipe, native = args.attribute, {"32-true": "float32", "16-mixed": "mixed_float16"}.get(
            args.attribute, "mixed_bfloat16")
        makers = {f"ours {recipe}": (make_ours, (recipe,)), f"native {recipe}": (make_native, (native,)),
                  **{f"ours {recipe}, {off} off": (make_ours, (recipe, False, False, off)) for off in OFF}}
        PAIRS[:] = [(f"ours {recipe}", f"native {recipe}", "<= 1.02"),
                    *((f"ours {recipe}", f"ours {recipe}, {off} off", "the piece's share") for off in OFF),
                    *((f"ours {recipe}, {off} off", f"native {recipe}", "what is left") for off in OFF)]
        NATIVES[:] = [f"native {recipe}"]

    def by_fit(name: str):
        make, make_args = makers[name]
        return lambda: fit(*make(*make_args))

    def stepped(name: str):
        make, make_args = makers[name]
        return lambda clock: compiled(*make(*make_args), clock=clock)

    pairs = [p for p in PAIRS if p[0] in makers and p[1] in makers
             and (args.only is None or any(t in p[0] for t in args.only))]
    names = list(dict.fromkeys(n for p in pairs for n in p[:2]))
    natives = [n for n in NATIVES if n in names]
    print(machine_line(args.threads) + pinned)
    keras_ext.check_native.native_check()  # built (once per machine) and loaded before any step is timed
    keras_ext.master_native.native_master_adam()
    if args.by_fit:
        times = alternate(with_controls({n: by_fit(n) for n in names}, natives), args.rounds)
        how = f"{args.steps} steps/fit, {args.rounds} fits alternating"
    else:
        with graph_options():  # process-wide: set once around every thread's fit
            times = lockstep(with_controls({n: stepped(n) for n in names}, natives), args.steps, args.rounds,
                             cpu=time.process_time)  # TF's kernels run on its own pool threads
        how = f"{args.steps} steps alternating step by step, {args.rounds} windows"
    n_params = build().count_params()
    model_name = "keras_hub GPT2Backbone + tied head" if args.model == "keras_hub" else "GPT-2-style transformer"
    data = print_tables(
        f"Keras {keras.__version__} ({keras.backend.backend()}), {model_name} ({args.layers} layers, "
        f"d_model {d}, seq {seq}, vocab {vocab}, {n_params} params), batch {args.batch_size}, {how}, "
        f"{args.threads} thread(s), AdamW, jit_compile=False", times, pairs)
    skipped = [r for r in ("bf16-kahan", "bf16-sr") if f"ours {r}" not in makers and not args.attribute]
    if skipped:
        print(f"  not run: {', '.join(skipped)} (keras_ext does not implement them here)")
    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump({"machine": machine_line(args.threads), "results": [data]}, fh, indent=2)


OFF = ("finite check", "divergence rule", "host latch read", "cond", "all but the update")
"""``--attribute``: the pieces of ours switched off one at a time (``cond``: the update runs unconditionally; the
last: the inner update alone, with the masters' write-back: no finite check, scaler, rule, cond or host read)."""


def switch_off(opt: Any, off: str | None) -> None:
    """Switch one of :data:`OFF` off on ``opt`` (instance attributes: the other variants keep theirs)."""
    from keras import ops

    if off == OFF[0]:
        opt._found_inf = lambda grads: ops.convert_to_tensor(False)
    if off in OFF[2::2]:
        opt._divergence.check = lambda: None
    if off == OFF[3]:
        import keras_ext.optimizer_step as module

        def unconditional(*args: Any) -> Any:
            before, module.run_if = module.run_if, lambda cond, fn, variables: fn()
            try:  # traced in turn (lock-step): no other variant traces meanwhile
                return type(opt)._step(opt, *args)
            finally:
                module.run_if = before
        opt._step = unconditional
    if off == OFF[4]:
        def inner_only(grads: Any, tvs: Any, unscaled_already: bool) -> None:
            opt._apply_inner(opt._unscaled(grads, tvs, unscaled_already), tvs)
            opt._masters.write_back(tvs, opt._get_variable_index)
        opt._tf_apply = inner_only


def main() -> None:
    parser = base_parser(__doc__, rounds=6, steps=120, batch_size=4)
    parser.set_defaults(threads=[1])
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT")
    parser.add_argument("--model", choices=["tiny", "keras_hub"], default="tiny",
                        help="tiny: the hand-written GPT-2 twin; keras_hub: keras_hub's GPT2Backbone from a config")
    parser.add_argument("--by-fit", action="store_true",
                        help="alternate whole fits (--rounds fits per variant) instead of single steps")
    parser.add_argument("--profile", action="store_true",
                        help="count the train step's ops per variant (bf16) instead of timing the variants")
    parser.add_argument("--attribute", default=None, metavar="RECIPE",
                        help="ours under RECIPE with each piece switched off in turn (see OFF), against native")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        worker(args)
        return
    passthrough = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                   "--seq", str(args.seq), "--d-model", str(args.d_model), "--layers", str(args.layers),
                   "--vocab", str(args.vocab), "--model", args.model]
    if args.only:
        passthrough += ["--only", *args.only]
    if args.profile:
        passthrough.append("--profile")
    if args.attribute:
        passthrough += ["--attribute", args.attribute]
    if args.by_fit:
        passthrough.append("--by-fit")
    if args.no_pin:
        passthrough.append("--no-pin")
    env = dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow"))
    for threads in args.threads:
        env["OMP_NUM_THREADS"] = str(threads)
        extra = ["--json", f"{args.json}.{threads}" if len(args.threads) > 1 else args.json] if args.json else []
        proc = subprocess.run([sys.executable, __file__, "--worker", "--threads", str(threads), *passthrough, *extra],
                              env=env, cwd=str(ROOT), capture_output=True, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
