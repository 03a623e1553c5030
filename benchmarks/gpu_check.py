"""The prepared GPU check: ``pytest -m cuda``, the launch and sync counter on the device, bytes per parameter, ours
vs native per recipe on a GPT-2-small-size model, and FP8 against bf16 on a stack of large Linear layers.

    python3 benchmarks/gpu_check.py --out DIR [--rounds 3] [--steps 4] [--batch 8] [--no-hf] [--wheels DIR ...]
        [--cpu-dry-run]

Run from the repository root with the project on ``PYTHONPATH``; it writes ``gpu_check.json`` and
``gpu_check.md`` into ``--out`` after every section (a run cut short keeps what it measured) and prints the
Markdown at the end.  Sections, in order (sized for under 8 minutes on one H100; not yet run on a GPU):

1. ``python -m pytest -m cuda tests/cuda`` in a subprocess (with a timeout); the pass/fail/skip counts come from its
   JUnit XML.  Where this Python has no pytest, wheels found in ``--wheels`` (default: ``shared/wheels``,
   ``benchmarks/wheels``) are unpacked under ``--out`` and put on the subprocess's path (pure-Python packages);
2. ``launches.py`` on the device: per recipe, Trainer and Fabric, ``AdamW(foreach=True)`` and ``fused=True``, the
   ops, kernels and host syncs of one step, ours vs native; the syncs also as torch counts them
   (``torch.cuda.set_sync_debug_mode("warn")``);
3. bytes per parameter of model state at the optimizer step, per recipe: the CUDA allocator above its level before
   the model existed, next to ``mp_callbacks.estimate_memory``;
4. a GPT-2-small-size model (Hugging Face ``GPT2LMHeadModel`` from a ``GPT2Config``: 12 layers, 768 wide, seq
   1024, vocab padded to 50304, random init; the built-in twin without ``transformers``), batch 8 (every variant
   stays resident while they take turns: 18 GPT-2-small models with their AdamW states), AdamW:
   ours vs native per recipe (``harness.py``: variants in turns, natives with controls, the device synchronised at
   every step's start and end), ms per step and each variant's peak memory above its resting state;
5. ``fp8-mixed`` against ``bf16-mixed`` on 8 x ``Linear(4096, 4096)`` over 16384 tokens: the training step, and the
   forward pass alone (where the tensor-core matmuls are the difference), with the ``_scaled_mm`` calls counted.

``--cpu-dry-run``: the same code paths on the CPU with tiny sizes (what ``make test`` runs); what needs CUDA (the
allocator, peak memory, FP8 tensor cores, torch's sync count) is reported as "skipped: no CUDA".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

NO_CUDA = "skipped: no CUDA"


def machine_info(device: str) -> dict[str, Any]:
    """Versions and the device: what every figure of the report depends on."""
    import lightning

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "lightning": lightning.__version__, "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "device": device,
        "transformers": None, "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        info["transformers"] = transformers.__version__
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    gpu_memory_gb=round(props.total_memory / 2**30, 1),
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return info


def wheel_site(dirs: list[Path], out: Path) -> tuple[list[str], list[str]]:
    """Unpack every ``*.whl`` of ``dirs`` under ``out/_site`` (pure-Python wheels are zips of their packages);
    returns the paths to add and the wheel names."""
    wheels = sorted(w for d in dirs if d.is_dir() for w in d.glob("*.whl"))
    if not wheels:
        return [], []
    site = out / "_site"
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    return [str(site)], [w.name for w in wheels]


def importable(module: str, pythonpath: list[str]) -> bool:
    """Whether this Python imports ``module`` with ``pythonpath`` in front (checked in a subprocess)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0


def run_pytest(out: Path, timeout: float, wheel_dirs: list[Path]) -> dict[str, Any]:
    """``pytest -m cuda tests/cuda`` in a subprocess; its counts from the JUnit XML.  Without pytest here,
    the wheels of ``wheel_dirs`` are unpacked and put on the subprocess's path first."""
    extra: list[str] = []
    wheels: list[str] = []
    if not importable("pytest", [str(REPO)]):
        extra, wheels = wheel_site(wheel_dirs, out)
        if not wheels or not importable("pytest", [str(REPO), *extra]):
            return {"status": f"not run: this Python has no pytest and no usable wheel was found in "
                              f"{', '.join(map(str, wheel_dirs))}", "wheels": wheels}
    junit = out / "pytest_cuda.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/cuda", "-p", "no:cacheprovider", "-q", "-rs",
           f"--junitxml={junit}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *extra, os.environ.get("PYTHONPATH", "")]))
    env.pop("MP_CUDA_TESTS_DEVICE", None)
    t0 = time.monotonic()
    result: dict[str, Any] = {"command": " ".join(cmd[1:]), "wheels": wheels}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"") if isinstance(exc.stdout, bytes) else (exc.stdout or "").encode()
        return {**result, "status": f"timed out after {timeout:.0f} s", "tail": tail.decode(errors="replace")[-3000:]}
    result.update(returncode=proc.returncode, seconds=round(time.monotonic() - t0, 1),
                  tail=(proc.stdout + proc.stderr)[-3000:])
    if not junit.exists():
        return {**result, "status": f"pytest exited {proc.returncode} without a JUnit report"}
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    status = "passed" if proc.returncode == 0 else f"pytest exited {proc.returncode}"
    return {**result, **counts, "status": status}


def guarded(report: dict[str, Any], section: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, its wall seconds in ``report["section_s"]``; an exception is recorded in ``report["errors"]``
    (the other sections still run)."""
    t0 = time.monotonic()
    try:
        return fn()
    except Exception:  # noqa: BLE001 - one broken section must not lose the others
        report.setdefault("errors", {})[section] = traceback.format_exc()[-4000:]
        print(f"\n{section}: FAILED\n{report['errors'][section]}", file=sys.stderr)
        return None
    finally:
        report.setdefault("section_s", {})[section] = round(time.monotonic() - t0, 1)


def fmt(v: Any, spec: str = ".3f") -> str:
    if isinstance(v, (int, float)) and math.isfinite(v):
        return format(v, spec)
    return "-" if v is None else str(v)

def counter_section(sizes: Any, device: str) -> dict[str, Any]:
    """``launches.py`` on the device (the transformer benchmark model), Trainer and Fabric, foreach and fused."""
    import gpu_check_parts as parts
    import launches

    full = device == "cuda"  # the dry run: the Trainer, two recipes, AdamW(fused=True)
    argv = ["--frameworks", *(["trainer", "fabric"] if full else ["trainer"]), "--models", "tiny",
            "--optimizers", *(["foreach", "fused"] if full else ["fused"]),
            "--recipes", *(parts.RECIPES if full else ["16-mixed", "bf16-master"]),
            "--device", device, "--d-model", str(sizes.counter_d_model), "--layers", str(sizes.counter_layers),
            "--warmup", "2"]
    return {"rows": launches.main(argv)}


def gpt_section(make_net: Callable[[], Any], desc: str, sizes: Any, device: str) -> dict[str, Any]:
    """Ours vs native per recipe on the GPT model (and bf16-master vs native bf16-mixed, both AdamW(fused=True))."""
    import gpu_check_parts as parts
    import lightning_variants as lv
    import torch_models as tm
    from harness import Variant

    batches = parts.gpt_batches(sizes, 8, sizes.batch)
    ours = [Variant("ours", r) for r in parts.RECIPES] + [Variant("ours", "bf16-master", "fused")]
    pairs = [(v, v.reference()) for v in ours]
    variants = list(dict.fromkeys(v for p in pairs for v in p))
    builds = {v.name: lv.trainer_build(v, make_net, batches, tm.lm_loss, device) for v in variants}
    data = parts.timed(builds, [v.name for v in variants if v.side == "native"],
                       [(a.name, b.name) for a, b in pairs], sizes, device)
    n = sum(p.numel() for p in make_net().parameters())
    return {"model": desc, "params": n, "batch": sizes.batch, "seq": sizes.seq, **data}


def linear_section(sizes: Any, device: str) -> dict[str, Any]:
    """``fp8-mixed`` vs ``bf16-mixed`` on the Linear stack: training steps (Trainer), then forward passes alone."""
    import gpu_check_parts as parts
    import lightning_variants as lv
    from harness import Variant

    make = lambda: parts.LinearStack(sizes.linear_dim, sizes.linear_depth, sizes.linear_tokens)  # noqa: E731
    batches = [(torch.zeros(1), torch.zeros(1))]
    names = [Variant("ours", "fp8-mixed"), Variant("ours", "bf16-mixed"), Variant("native", "bf16-mixed")]
    builds = {v.name: lv.trainer_build(v, make, batches, parts.square_loss, device) for v in names}
    pairs = [("ours fp8-mixed", "ours bf16-mixed"), ("ours fp8-mixed", "native bf16-mixed"),
             ("ours bf16-mixed", "native bf16-mixed")]
    train = parts.timed(builds, ["native bf16-mixed"], pairs, sizes, device)
    return {"layers": f"{sizes.linear_depth} x Linear({sizes.linear_dim}, {sizes.linear_dim}, bias=False)",
            "tokens": sizes.linear_tokens, "train": train, "forward": parts.linear_forward(sizes, device)}


def timing_md(title: str, data: dict[str, Any]) -> list[str]:
    import harness

    def peak(v: dict[str, Any]) -> str:
        mb = v.get("peak_mb_above_rest")
        return fmt(mb, ".0f") if mb is not None else "-" if CUDA[0] else NO_CUDA

    lines = [harness.markdown(title, data), "| variant | peak MB above its resting state |", "|---|---|"]
    return lines + [f"| {k} | {peak(v)} |" for k, v in data["variants"].items()] + [""]


CUDA = [False]  # set by main: whether this run is on CUDA


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown (the same figures as the JSON)."""
    import launches

    m = report["machine"]
    dev = (f"{m.get('gpu')} (sm {m.get('capability')}, {m.get('gpu_memory_gb')} GB)" if m["device"] == "cuda"
           else "CPU dry run")
    out = [f"# GPU check: {dev}", "",
           f"{m['date']}; python {m['python']}, torch {m['torch']} (CUDA {m['torch_cuda']}), lightning "
           f"{m['lightning']}, transformers {m['transformers']}; wall {fmt(report.get('wall_s'), '.0f')} s", ""]
    p = report.get("pytest") or {}
    out += [f"**pytest -m cuda tests/cuda**: {p.get('status')}; {p.get('passed', '-')} passed, "
            f"{p.get('failures', '-')} failed, {p.get('errors', '-')} errors, {p.get('skipped', '-')} skipped "
            f"({fmt(p.get('seconds'), '.0f')} s)", ""]
    if report.get("counter"):
        out += ["## Launches and host syncs of one step (launches.py)", "",
                launches.markdown(report["counter"]["rows"]), ""]
    if report.get("bytes_per_param"):
        out += ["## Model-state bytes/param at the optimizer step (AdamW)", "",
                "| recipe | CUDA allocator | estimate_memory | FP32 params |", "|---|---|---|---|"]
        for r in report["bytes_per_param"]:
            held = r["allocated_bytes_per_param"]
            out.append(f"| {r['recipe']} | {NO_CUDA if held is None else fmt(held, '.2f')} | "
                       f"{fmt(r['estimate_bytes_per_param'], '.2f')} | {r['fp32_params']} |")
        out.append("")
    g = report.get("gpt2")
    if g:
        out += timing_md(f"{g['model']}: {g['params']:,} params, batch {g['batch']} x seq {g['seq']}, AdamW", g)
    lin = report.get("linear_fp8")
    if lin:
        out += timing_md(f"fp8-mixed vs bf16-mixed, training step: {lin['layers']}, {lin['tokens']} tokens",
                         lin["train"])
        out += timing_md(f"Forward pass alone, no grad (torch._scaled_mm per forward: "
                         f"{lin['forward']['scaled_mm_per_forward']})", lin["forward"])
    for title, key in (("Skipped", "skipped"), ("Notes", "notes")):
        if report.get(key):
            out += [f"## {title}", ""] + [f"- {line}" for line in report[key]] + [""]
    if report.get("errors"):
        out += ["## Errors", ""] + [f"- {k}: `{v.strip().splitlines()[-1]}`" for k, v in report["errors"].items()]
    return "\n".join(out)


def write(report: dict[str, Any], out: Path) -> str:
    text = markdown(report)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(text)
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json / gpu_check.md")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU; CUDA parts skipped")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per section (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant per round (default 4)")
    parser.add_argument("--batch", type=int, default=None, help="GPT batch (default 8)")
    parser.add_argument("--pytest-timeout", type=float, default=150.0)
    parser.add_argument("--no-hf", action="store_true",
                        help="the built-in GPT twin even where transformers is installed")
    parser.add_argument("--wheels", type=Path, nargs="*",
                        default=[REPO / "shared" / "wheels", REPO / "benchmarks" / "wheels"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when every section ran (test failures are reported, not raised), else 1."""
    args = parse_args(argv)
    start = time.monotonic()
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --cpu-dry-run", file=sys.stderr)
        return 2
    CUDA[0] = device == "cuda"
    import gpu_check_parts as parts
    import harness

    harness.quiet()
    torch.set_num_threads(1 if args.cpu_dry_run else torch.get_num_threads())
    sizes = parts.DRY_SIZES if args.cpu_dry_run else parts.Sizes()
    sizes = dataclasses.replace(sizes, **{k: v for k, v in (("rounds", args.rounds), ("steps", args.steps),
                                                            ("batch", args.batch)) if v})
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine_info(device), "sizes": vars(sizes), "skipped": [], "notes": []}
    if device != "cuda":
        report["skipped"] += [f"peak memory (torch.cuda.max_memory_allocated): {NO_CUDA}",
                              f"bytes/param by the CUDA allocator: {NO_CUDA} (the estimate is given)",
                              f"FP8 tensor cores (torch._scaled_mm): {NO_CUDA} (the FP8 emulation ran)",
                              f"torch's own sync count (set_sync_debug_mode): {NO_CUDA}",
                              f"pytest -m cuda: ran, its tests {NO_CUDA}"]
    elif torch.cuda.get_device_capability(0) < (8, 9):
        report["skipped"].append("FP8 tensor cores (torch._scaled_mm): compute capability "
                                 f"{report['machine']['capability']} < 8.9 (the FP8 emulation ran)")
    print(f"gpu_check on {device}: pytest -m cuda ...", flush=True)
    report["pytest"] = guarded(report, "pytest", lambda: run_pytest(args.out, args.pytest_timeout, list(args.wheels))
                               ) or {"status": "failed to run"}
    write(report, args.out)
    print("launches and syncs per step ...", flush=True)
    report["counter"] = guarded(report, "counter", lambda: counter_section(sizes, device))
    write(report, args.out)
    use_hf = not args.no_hf and importlib.util.find_spec("transformers") is not None and not args.cpu_dry_run
    if not use_hf:
        why = "--cpu-dry-run" if args.cpu_dry_run else "--no-hf" if args.no_hf else "transformers is not installed"
        report["notes"].append(f"GPT model: the built-in TinyGPT twin ({why}), not Hugging Face's GPT2LMHeadModel")
    made = guarded(report, "gpt_model", lambda: parts.gpt_factory(sizes, use_hf))
    if made is not None:
        make_net, desc = made
        print("bytes/param per recipe ...", flush=True)
        small = parts.gpt_batches(sizes, 3, sizes.bytes_batch)
        report["bytes_per_param"] = guarded(report, "bytes_per_param", lambda: [
            parts.bytes_per_param_row(r, make_net, small, device) for r in parts.RECIPES])
        write(report, args.out)
        print("GPT: ours vs native, in turns ...", flush=True)
        report["gpt2"] = guarded(report, "gpt2", lambda: gpt_section(make_net, desc, sizes, device))
        write(report, args.out)
        parts.release(device)
    print("Linear stack: fp8-mixed vs bf16-mixed ...", flush=True)
    report["linear_fp8"] = guarded(report, "linear_fp8", lambda: linear_section(sizes, device))
    report["wall_s"] = time.monotonic() - start
    text = write(report, args.out)
    print("\n" + text)
    print(f"written: {args.out / 'gpu_check.json'}, {args.out / 'gpu_check.md'}")
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
