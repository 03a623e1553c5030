"""What does a training step cost with ours instead of native, per recipe?  (step time, ours / native)

    python benchmarks/overhead.py [--frameworks trainer fabric keras] [--model tiny|hf] [--only TEXT ...]
        [--rounds 7] [--steps 30] [--warmup 3] [--threads 1] [--d-model 128] [--layers 2] [--seq 32]
        [--batch-size 4] [--json PATH] [--no-pin]

The transformer benchmark model (``--model tiny``: ``torch_models.TinyGPT`` / ``keras_models``' twin) or a Hugging
Face model built from a config of the same size (``--model hf``: ``transformers``' ``GPT2LMHeadModel`` for
Lightning, keras_hub's ``GPT2Backbone`` with its tied head for Keras), random-token batches, the user's AdamW
(lr 1e-3) untouched on both sides.  Per framework (``trainer``: ``Trainer(plugins=[...])``; ``fabric``: a Fabric
loop; ``keras``: ``model.fit``, in a subprocess on ``KERAS_BACKEND``'s backend, TensorFlow by default, with its
thread pools set to ``--threads``) the rows are:

* ours ``32-true``, ``16-mixed``, ``bf16-mixed`` against native's same recipe;
* ours ``bf16-master`` against native ``bf16-mixed``, and both with ``AdamW(fused=True)`` (Lightning);
* ours ``16-master`` against native ``16-mixed``; ``bf16-kahan``, ``bf16-sr``, ``fp8-mixed`` against native
  ``bf16-mixed``.

The variants of a framework alternate in one process (``harness.py``: rounds of ``--steps`` steps per variant,
every native also run as its control); the table gives ours / native as the median of per-round ratios with the
min-max, in wall and CPU time, with the control's beside.  ``--only TEXT``: the rows whose ours contains a TEXT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import Variant  # noqa: E402

FRAMEWORKS = ("trainer", "fabric", "keras")
ROWS = [("32-true", "default"), ("16-mixed", "default"), ("bf16-mixed", "default"), ("bf16-master", "default"),
        ("bf16-master", "fused"), ("16-master", "default"), ("bf16-kahan", "default"), ("bf16-sr", "default"),
        ("fp8-mixed", "default")]


def pairs_for(framework: str, only: list[str] | None) -> list[tuple[Variant, Variant]]:
    """(ours, native) per row; Keras has no fused row (its AdamW has one implementation)."""
    out = []
    for recipe, optimizer in ROWS:
        if framework == "keras" and optimizer != "default":
            continue
        ours = Variant("ours", recipe, optimizer)
        if only is None or any(t in ours.name for t in only):
            out.append((ours, ours.reference()))
    return out


def builds(framework: str, args: argparse.Namespace, variants: list[Variant]) -> dict:
    """``{name: harness build}`` of ``variants`` on the chosen model."""
    if framework == "keras":
        import keras_variants as kv

        return {v.name: kv.fit_build(v, args.model, args.vocab, args.seq, args.d_model, args.layers, args.batch_size)
                for v in variants}
    import lightning_variants as lv
    import torch_models as tm

    cfg = tm.GPTConfig.sized(args.d_model, args.layers, args.seq, args.vocab)
    batches = tm.token_batches(cfg, 64, args.batch_size)
    return {v.name: lv.BUILDERS[framework](v, lambda: tm.build(args.model, cfg), batches, tm.lm_loss)
            for v in variants}


def section(framework: str, args: argparse.Namespace) -> dict:
    """Time one framework's rows; print and return the summary."""
    pairs = pairs_for(framework, args.only)
    variants = list(dict.fromkeys(v for pair in pairs for v in pair))
    references = [v.name for v in variants if v.side == "native"]
    times = harness.run_rounds(harness.with_controls(builds(framework, args, variants), references),
                               args.rounds, args.steps, args.warmup)
    data = harness.summarize(times, [(a.name, b.name) for a, b in pairs])
    hf = "keras_hub GPT2Backbone from a config" if framework == "keras" else "Hugging Face GPT-2 from a config"
    model = {"tiny": "the transformer benchmark model", "hf": hf}[args.model]
    title = (f"{framework}: {model} (d_model {args.d_model}, {args.layers} layers, seq {args.seq}, "
             f"vocab {args.vocab}), batch {args.batch_size}, AdamW; {args.rounds} rounds x {args.steps} steps")
    print(harness.machine_line(args.threads))
    print(harness.markdown(title, data), flush=True)
    return {"framework": framework, "title": title, "machine": harness.machine_line(args.threads), **data}


def keras_subprocess(args: argparse.Namespace, argv: list[str]) -> dict:
    """The Keras section in a subprocess (TensorFlow's thread pools are fixed when it starts)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "keras.json")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run([sys.executable, __file__, *argv, "--frameworks", "keras", "--keras-worker", out],
                              env=env, cwd=ROOT, text=True, stdout=None, stderr=subprocess.PIPE)
        if proc.returncode:
            raise RuntimeError(f"the Keras worker failed:\n{proc.stderr[-4000:]}")
        with open(out) as fh:
            return json.load(fh)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, rounds=7, steps=30, warmup=3)
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--model", choices=["tiny", "hf"], default="tiny")
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--keras-worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    harness.quiet()
    if args.keras_worker:
        harness.setup(args, tensorflow=os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow")
        data = section("keras", args)
        with open(args.keras_worker, "w") as fh:
            json.dump(data, fh)
        return [data]
    harness.setup(args)
    passed = [a for i, a in enumerate(argv) if a != "--frameworks" and not (
        i and argv[i - 1] == "--frameworks") and a not in FRAMEWORKS]
    results = [keras_subprocess(args, passed) if f == "keras" else section(f, args) for f in args.frameworks]
    harness.write_json(args.json, results, args.threads)
    return results


if __name__ == "__main__":
    main()
