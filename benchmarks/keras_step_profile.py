"""``bench_transformer_keras.py --profile``: the Keras train step's op counts per variant and ours' graph pieces alone.

The step's graph is counted exactly (every op type of the traced train function and of its library's functions,
each function once), per variant, and diffed against native bf16-mixed: exact where step times on a shared CPU
are not.  :func:`pieces` times ours' per-step pieces each as a ``tf.function`` of its own (the finite check, the
unscale, the widening, the masters' write-back, candidate checks), alternating, CPU ms per call.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

__all__ = ["PROFILED", "op_counts", "pieces", "profile"]

PROFILED = [("native bf16-mixed", "native", ("mixed_bfloat16",)), ("ours bf16-mixed", "ours", ("bf16-mixed",)),
            ("ours bf16-master", "ours", ("bf16-master",))]


def op_counts(train_function: Any) -> Counter:
    """Op types of Keras' traced train step: the ``tf.function`` behind ``model.train_function`` (its
    graph and every function of its library, each once: the while loop's body, the step on one batch)."""
    while not hasattr(train_function, "__closure__") and hasattr(train_function, "fn"):
        train_function = train_function.fn  # keras_ext.divergence: the host check after the step
    traced = [c.cell_contents for c in train_function.__closure__ or ()
              if hasattr(c.cell_contents, "_list_all_concrete_functions")]
    counts: Counter = Counter()
    seen: set[str] = set()
    for function in traced:
        for concrete in function._list_all_concrete_functions():  # noqa: SLF001 - no public way to the graphs
            graph_def = concrete.graph.as_graph_def()
            if concrete.name not in seen:
                seen.add(concrete.name)
                counts.update(n.op for n in graph_def.node)
            for f in graph_def.library.function:
                if f.signature.name not in seen:
                    seen.add(f.signature.name)
                    counts.update(n.op for n in f.node_def)
    return counts


def profile(args: argparse.Namespace, fit: Any, make_native: Any, make_ours: Any) -> None:
    """``--profile``: the train step's graph, op types counted per variant and diffed against native bf16-mixed
    (exact, unlike step times on a shared CPU), next to each fit's median step."""
    from common import machine_line

    print(machine_line(args.threads) + getattr(args, "pinned", ""))
    counts: dict[str, Counter] = {}
    models: dict[str, Any] = {}
    for name, kind, make_args in PROFILED:
        model, opt = (make_native if kind == "native" else make_ours)(*make_args)
        wall, cpu = fit(model, opt)
        counts[name], models[name] = op_counts(model.train_function), model
        print(f"  {name:<20} {sum(counts[name].values()):5d} ops in the train step's graph; "
              f"median step {1000 * cpu:.2f} ms CPU, {1000 * wall:.2f} ms wall (one fit, {args.steps} steps)")
    print(pieces(args, models))
    names = [n for n, _, _ in PROFILED]
    base = counts[names[0]]
    ops_ = sorted(set().union(*counts.values()),
                  key=lambda op: -max(abs(counts[n][op] - base[op]) for n in names[1:]))
    print("\n  op type                      " + "".join(f"{n:>20}" for n in names) + "   (diff vs native)")
    for op in ops_:
        diffs = [counts[n][op] - base[op] for n in names[1:]]
        if any(diffs):
            print(f"  {op:<28} " + "".join(f"{counts[n][op]:>20}" for n in names)
                  + "   " + " ".join(f"{d:+d}" for d in diffs))


def pieces(args: argparse.Namespace, models: dict[str, Any]) -> str:
    """Ours' per-step graph pieces alone (each a ``tf.function`` on the models' variables, 200 calls a round,
    alternating, CPU ms per call): what the op counts attribute to keras_ext."""
    import tensorflow as tf
    from common import alternate, by_clock, per_step
    from keras import ops

    from keras_ext.grad_check import found_inf, unscale

    def grads_of(model: Any) -> list[Any]:
        return [tf.random.normal(v.shape, dtype=v.dtype) * 1e-3 for v in model.trainable_variables]

    mixed, master = models["ours bf16-mixed"], models["ours bf16-master"]
    g32, g16 = grads_of(mixed), grads_of(master)
    one = tf.constant(1.0)
    lows = master.trainable_variables
    masters = [tf.Variable(tf.cast(v, "float32")) for v in lows]
    check = getattr(master.train_function, "check", None)

    def write_back() -> None:
        for v, m in zip(lows, masters):
            v.assign(ops.cast(m, v.dtype))

    graphs = {
        "empty tf.function call (subtract from each piece)": tf.function(lambda: one),
        "finite check, bf16-mixed's FP32 gradients": tf.function(lambda: found_inf(g32)),
        "finite check, bf16-master's bf16 gradients": tf.function(lambda: found_inf(g16)),
        "unscale by 1 (divide), FP32 gradients": tf.function(lambda: [unscale(g, one) for g in g32]),
        "widen + unscale by 1, bf16 gradients": tf.function(lambda: [unscale(g, one) for g in g16]),
        "widen only (cast), bf16 gradients": tf.function(lambda: [ops.cast(g, "float32") for g in g16]),
        "masters rounded into the bf16 variables": tf.function(write_back),
        "candidate check: reduce_max + reduce_min, FP32": tf.function(lambda: ops.logical_not(ops.all(
            ops.isfinite(ops.stack([r for g in g32 for r in (ops.max(g), ops.min(g))]))))),
        "candidate check: sum(g * 0), FP32": tf.function(
            lambda: ops.logical_not(ops.isfinite(ops.sum(ops.stack([ops.sum(g * 0.0) for g in g32]))))),
        "candidate check: two-stage (sums, exact under cond), FP32": tf.function(lambda: ops.logical_not(tf.cond(
            tf.math.is_finite(tf.add_n([tf.reduce_sum(g) for g in g32])), lambda: tf.constant(True),
            lambda: ops.logical_not(found_inf(g32))))),
    }
    bodies = {k: (lambda f=f: tf.nest.map_structure(lambda t: t, f())) for k, f in graphs.items()}
    if check is not None:
        bodies["divergence host check after the step (eager)"] = check
    for body in bodies.values():
        body()  # trace
    times = by_clock(alternate({k: per_step(v, 200) for k, v in bodies.items()}, args.rounds))["cpu"]
    import statistics

    lines = [f"\n  pieces alone ({len(g32)} gradients, {sum(int(tf.size(g)) for g in g32)} values; CPU ms per call, "
             f"median of {args.rounds} rounds of 200 (min-max))"]
    for k, ts in times.items():
        lines.append(f"  {k:<52} {1000 * statistics.median(ts):7.3f} ({1000 * min(ts):.3f}-{1000 * max(ts):.3f})")
    return "\n".join(lines)
