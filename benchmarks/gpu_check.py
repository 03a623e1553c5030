"""One prepared GPU check: ``pytest -m cuda``, then ours vs native side by side, alternating, with controls.

    python3 benchmarks/gpu_check.py --out DIR [--budget-s 420] [--rounds 5] [--batch 16] [--no-hf]
        [--wheels DIR ...] [--cpu-dry-run]

Run from the repository root with the project on ``PYTHONPATH``.  Within ``--budget-s`` seconds of
wall time (default 420: the whole check stays under 8 minutes and can be rerun once) it runs:

1. ``python -m pytest -m cuda tests/cuda`` in a subprocess (with a timeout); the pass/fail/skip
   counts come from its JUnit XML.  Where this Python has no pytest, wheels found in ``--wheels``
   (default: ``shared/wheels``, ``benchmarks/wheels``) are unpacked under ``--out`` and put on the
   subprocess's path (pure-Python packages only);
2. bytes/param of model state at the optimizer step, per recipe, measured on the device (the CUDA
   allocator above its level before the model existed, and the storages held) against
   ``mp_callbacks.estimate_memory`` for the dtypes the parameters ended in;
3. a GPT-2-small-size model (Hugging Face ``GPT2Config(n_layer=12, n_embd=768, n_head=12,
   n_positions=1024)``, random init, vocab padded to 50304 (a multiple of 64, as nanoGPT, so that
   the tied head's matmul is ``torch._scaled_mm``-shaped), seq 1024, batch 16): steps/s and
   ``torch.cuda.max_memory_allocated`` per recipe, ours against Lightning's native precision
   (``32-true``, ``16-mixed``, ``bf16-mixed``; the other recipes against ``bf16-mixed``);
4. ``fp8-mixed`` against ``bf16-mixed`` on a stack of 4096x4096 Linear layers: the training step,
   and the forward pass alone (where the tensor-core matmul is all of the difference).

Variants alternate in one process (``common.alternate``), each native one runs twice (the
control), ratios are medians of per-round ratios with their min-max.  Rounds stop being added
when the next one would pass its section's share of the budget.  It writes ``gpu_check.json`` and
``gpu_check.md`` into ``--out`` and prints the Markdown.

``--cpu-dry-run``: the same code paths on the CPU with tiny sizes (what ``make test`` runs); what
needs CUDA (peak memory, the allocator, FP8 tensor cores) is reported as "skipped: no CUDA".
``transformers`` is imported only when present; without it the built-in GPT twin runs, and the
report says so.
"""

from __future__ import annotations

import argparse
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
from common import summary, with_controls  # noqa: E402
from gpu_check_parts import (  # noqa: E402
    DRY_SIZES,
    LM,
    NATIVE_OF,
    NATIVES,
    RECIPES,
    LinearStack,
    Sizes,
    bytes_per_param_row,
    gpt_batches,
    gpt_template,
    linear_forward_rows,
    rounds_within,
    timed_variant,
)

NO_CUDA = "skipped: no CUDA"
GPT2_SHARE = 0.65
"""The GPT section's share of the budget left after pytest and bytes/param (the Linear stack gets the rest)."""


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


def steps_per_s(data: dict[str, Any], name: str) -> float | None:
    v = data["variants"].get(name)
    return 1000.0 / v["median_ms"] if v and v["median_ms"] > 0 and math.isfinite(v["median_ms"]) else None


def ratio_rows(data: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["ours"], r["native"]): r for r in data["ratios"]}


def memory(peaks: dict[str, list[tuple[float, float]]], prefix: str, name: str, device: str) -> dict[str, Any]:
    """``{prefix_peak_mb, prefix_start_mb}`` of a variant: its largest peak over rounds, and the most that was
    still allocated when one of its fits started ("skipped: no CUDA" on the CPU; None when it never ran)."""
    key = f"{prefix}_" if prefix else ""
    if device != "cuda":
        return {f"{key}peak_mb": NO_CUDA, f"{key}start_mb": NO_CUDA}
    runs = peaks.get(name)
    return {f"{key}peak_mb": max(p for p, _ in runs) if runs else None,
            f"{key}start_mb": max(s for _, s in runs) if runs else None}


def gpt2_section(template: Any, desc: str, sizes: Sizes, device: str, rounds: int, deadline: float) -> dict[str, Any]:
    """Ours vs native per recipe on the GPT model: steps/s, peak allocated MB, per-round step-time ratios."""
    batches = gpt_batches(sizes, sizes.warmup + sizes.steps, sizes.batch)
    peaks: dict[str, list[tuple[float, float]]] = {}
    errors: dict[str, str] = {}
    names = [f"ours {r}" for r in RECIPES] + [f"native {p}" for p in NATIVES]
    variants = {n: timed_variant(n, lambda: LM(template), batches, sizes.warmup, device, peaks, errors) for n in names}
    variants = with_controls(variants, [f"native {p}" for p in NATIVES])
    times, done = rounds_within(variants, rounds, deadline)
    pairs = [(f"ours {r}", f"native {NATIVE_OF[r]}", "<= 1.03" if r in NATIVES else "measured") for r in RECIPES]
    data = summary(times, pairs)
    by_pair = ratio_rows(data)
    rows = []
    for r in RECIPES:
        ours, native = f"ours {r}", f"native {NATIVE_OF[r]}"
        ratio = by_pair[(ours, native)]
        rows.append({
            "recipe": r, "native": NATIVE_OF[r], "ours_steps_per_s": steps_per_s(data, ours),
            "native_steps_per_s": steps_per_s(data, native),
            "step_time_ratio": ratio["median"], "ratio_min": ratio["min"], "ratio_max": ratio["max"],
            "control": ratio.get("control"),
            **memory(peaks, "ours", ours, device), **memory(peaks, "native", native, device),
            "error": errors.get(ours) or errors.get(native),
        })
    n_params = sum(p.numel() for p in template.parameters())
    return {"model": desc, "params": n_params, "batch": sizes.batch, "seq": sizes.seq, "warmup_steps": sizes.warmup,
            "timed_steps": sizes.steps, "rounds": done, "rows": rows, "summary": data, "errors": errors}


def linear_section(sizes: Sizes, device: str, rounds: int, deadline: float) -> dict[str, Any]:
    """``fp8-mixed`` vs ``bf16-mixed`` on the Linear stack: training steps (Trainer), then forward passes alone."""
    batches = [torch.zeros(1)] * (sizes.warmup + sizes.steps)
    peaks: dict[str, list[tuple[float, float]]] = {}
    errors: dict[str, str] = {}
    names = ["ours fp8-mixed", "ours bf16-mixed", "native bf16-mixed"]
    make = lambda: LinearStack(sizes.linear_dim, sizes.linear_depth, sizes.linear_tokens)  # noqa: E731
    variants = with_controls({n: timed_variant(n, make, batches, sizes.warmup, device, peaks, errors) for n in names},
                             ["native bf16-mixed"])
    train_deadline = time.monotonic() + 0.6 * max(deadline - time.monotonic(), 0)
    times, done = rounds_within(variants, rounds, train_deadline)
    fp8_target = "0.5-0.77 (1.3-2x faster) with FP8 tensor cores"
    train = summary(times, [("ours fp8-mixed", "ours bf16-mixed", fp8_target),
                            ("ours fp8-mixed", "native bf16-mixed", "measured"),
                            ("ours bf16-mixed", "native bf16-mixed", "<= 1.03")])
    fwd = linear_forward_rows(sizes, device, reps=max(sizes.steps, 2), rounds=rounds + 2, deadline=deadline)
    forward = summary(fwd["times"], [("ours fp8-mixed forward", "ours bf16-mixed forward", fp8_target),
                                     ("ours fp8-mixed forward", "native bf16-mixed forward", "measured"),
                                     ("ours bf16-mixed forward", "native bf16-mixed forward", "<= 1.03")])
    for name, v in train["variants"].items():
        v.update(memory(peaks, "", name.replace(" (control)", ""), device))
    return {"layers": f"{sizes.linear_depth} x Linear({sizes.linear_dim}, {sizes.linear_dim}, bias=False)",
            "tokens": sizes.linear_tokens, "train": train, "train_rounds": done, "forward": forward,
            "forward_rounds": fwd["rounds"], "scaled_mm_calls_per_forward": fwd["scaled_mm_calls_per_forward"],
            "errors": errors}


def fmt(v: Any, spec: str = ".3f") -> str:
    if isinstance(v, (int, float)) and math.isfinite(v):
        return format(v, spec)
    return "-" if v is None else str(v)


def ratio_md(title: str, data: dict[str, Any]) -> list[str]:
    lines = [title, "", "| ours | native | ours/native step time | min-max | control | target |",
             "|---|---|---|---|---|---|"]
    for r in data["ratios"]:
        c = r.get("control")
        ctl = f"{fmt(c['median'])} ({fmt(c['min'])}-{fmt(c['max'])})" if c else "-"
        lines.append(f"| {r['ours']} | {r['native']} | {fmt(r['median'])} | {fmt(r['min'])}-{fmt(r['max'])} | {ctl} | "
                     f"{r['target']} |")
    lines += ["", "| variant | median step ms | rounds min-max ms | peak MB |", "|---|---|---|---|"]
    for name, v in data["variants"].items():
        lines.append(f"| {name} | {fmt(v['median_ms'])} | {fmt(v['min_ms'])}-{fmt(v['max_ms'])} | "
                     f"{fmt(v.get('peak_mb'), '.0f')} |")
    return lines + [""]


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables (the same figures as the JSON)."""
    m = report["machine"]
    dev = (f"{m.get('gpu')} (sm {m.get('capability')}, {m.get('gpu_memory_gb')} GB)" if m["device"] == "cuda"
           else "CPU dry run")
    out = [f"# GPU check: {dev}", "",
           f"{m['date']}; python {m['python']}, torch {m['torch']} (CUDA {m['torch_cuda']}), "
           f"lightning {m['lightning']}, transformers {m['transformers']}; "
           f"wall {fmt(report.get('wall_s'), '.0f')} s of a {report['budget_s']:.0f} s budget", ""]
    p = report.get("pytest") or {}
    out += [f"**pytest -m cuda tests/cuda**: {p.get('status')}; {p.get('passed', '-')} passed, "
            f"{p.get('failures', '-')} failed, "
            f"{p.get('errors', '-')} errors, {p.get('skipped', '-')} skipped ({fmt(p.get('seconds'), '.0f')} s)", ""]
    rows = report.get("bytes_per_param")
    if rows:
        out += ["## Model-state bytes/param at the optimizer step (AdamW)", "",
                "| recipe | CUDA allocator | storages held | estimate_memory | FP32 params |", "|---|---|---|---|---|"]
        def allocated(r: dict[str, Any]) -> str:
            value = r["allocated_bytes_per_param"]
            return fmt(value, ".2f") if value is not None else NO_CUDA

        out += [f"| {r['recipe']} | {allocated(r)} | {fmt(r['held_bytes_per_param'], '.2f')} | "
                f"{fmt(r['estimate_bytes_per_param'], '.2f')} | {r['fp32_params']} |"
                for r in rows]
        out.append("")
    g = report.get("gpt2")
    if g:
        out += [f"## {g['model']}", "", f"{g['params']:,} params, batch {g['batch']} x seq {g['seq']}, AdamW, "
                f"{g['warmup_steps']} warm-up + {g['timed_steps']} timed steps per fit, {g['rounds']} round(s)", "",
                "| recipe | ours steps/s | native | native steps/s | ours/native step time (min-max) | control | "
                "ours peak MB | native peak MB |", "|---|---|---|---|---|---|---|---|"]
        for r in g["rows"]:
            c = r["control"]
            ctl = f"{fmt(c['median'])} ({fmt(c['min'])}-{fmt(c['max'])})" if c else "-"
            out.append(f"| {r['recipe']} | {fmt(r['ours_steps_per_s'], '.2f')} | {r['native']} | "
                       f"{fmt(r['native_steps_per_s'], '.2f')} | {fmt(r['step_time_ratio'])} ({fmt(r['ratio_min'])}-"
                       f"{fmt(r['ratio_max'])}) | {ctl} | {fmt(r['ours_peak_mb'], '.0f')} | "
                       f"{fmt(r['native_peak_mb'], '.0f')} |")
        out.append("")
    lin = report.get("linear_fp8")
    if lin:
        out += [f"## fp8-mixed vs bf16-mixed: {lin['layers']}, {lin['tokens']} tokens", ""]
        out += ratio_md(f"Training step ({lin['train_rounds']} round(s)):", lin["train"])
        out += ratio_md(f"Forward pass alone, no grad ({lin['forward_rounds']} round(s); torch._scaled_mm calls per "
                        f"forward: {lin['scaled_mm_calls_per_forward']}):", lin["forward"])
    for title, key in (("Skipped", "skipped"), ("Notes", "notes")):
        if report.get(key):
            out += [f"## {title}", ""] + [f"- {line}" for line in report[key]] + [""]
    if report.get("errors"):
        out += ["## Errors", ""] + [f"- {k}: `{v.strip().splitlines()[-1]}`"
                                    for k, v in report["errors"].items()] + [""]
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json / gpu_check.md")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU; CUDA parts skipped")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall seconds before no round is added")
    parser.add_argument("--rounds", type=int, default=None,
                        help="most alternating rounds per timed section (default 5, fewer when the budget "
                             "runs out; 1 with --cpu-dry-run)")
    parser.add_argument("--batch", type=int, default=None, help="GPT batch (default 16 on CUDA)")
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
    end = start + args.budget_s
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --cpu-dry-run", file=sys.stderr)
        return 2
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.rounds is None:
        args.rounds = 1 if args.cpu_dry_run else 5
    sizes = DRY_SIZES if args.cpu_dry_run else Sizes(**({"batch": args.batch} if args.batch else {}))
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine_info(device), "budget_s": args.budget_s, "sizes": vars(sizes),
                              "skipped": [], "notes": []}
    print(f"gpu_check on {device}: pytest -m cuda ...", flush=True)
    report["pytest"] = guarded(report, "pytest", lambda: run_pytest(
        args.out, min(args.pytest_timeout, 0.4 * args.budget_s), list(args.wheels))) or {"status": "failed to run"}
    print(f"  {report['pytest'].get('status')}: {report['pytest'].get('passed', '-')} passed, "
          f"{report['pytest'].get('skipped', '-')} skipped", flush=True)
    use_hf = not args.no_hf and importlib.util.find_spec("transformers") is not None and not args.cpu_dry_run
    if not use_hf:
        why = "--cpu-dry-run" if args.cpu_dry_run else "--no-hf" if args.no_hf else "transformers is not installed"
        report["notes"].append(f"GPT model: the built-in TinyGPT twin ({why}), not Hugging Face's GPT2LMHeadModel")
    if device != "cuda":
        report["skipped"] += [f"peak memory (torch.cuda.max_memory_allocated): {NO_CUDA}",
                              f"bytes/param by the CUDA allocator: {NO_CUDA} (the storages held are measured)",
                              f"FP8 tensor cores (torch._scaled_mm): {NO_CUDA} (the FP8 emulation ran)",
                              f"pytest -m cuda: ran, its tests {NO_CUDA}"]
    elif torch.cuda.get_device_capability(0) < (8, 9):
        report["skipped"].append("FP8 tensor cores (torch._scaled_mm): skipped: compute capability "
                                 f"{report['machine']['capability']} < 8.9 (the FP8 emulation ran)")
    report["notes"].append("fp8-mixed runs torch._scaled_mm in the forward pass only; its backward matmuls are "
                           "float32 matmuls of the dequantized FP8 operands (lightning_ext/fp8_matmul.py), so the "
                           "training-step ratio includes that cost; the forward-only rows isolate the tensor cores")
    template = desc = None
    made = guarded(report, "gpt_template", lambda: gpt_template(sizes, use_hf))
    if made is not None:
        template, desc = made

    if template is not None:
        print("bytes/param per recipe ...", flush=True)
        small = gpt_batches(sizes, 3, sizes.bytes_batch, sizes.bytes_seq)
        report["bytes_per_param"] = guarded(report, "bytes_per_param", lambda: [
            bytes_per_param_row(r, template, small, device) for r in RECIPES])
        for row in report["bytes_per_param"] or []:
            if row["fp8_matmuls"] is not None:  # Hugging Face's GPT-2 computes its blocks with Conv1D, not nn.Linear
                names = row["fp8_matmuls"]
                report["notes"].append(f"fp8-mixed on the GPT model: {len(names)} FP8 matmul(s) ({', '.join(names[:4])}"
                                       f"{', ...' if len(names) > 4 else ''}); every other matmul computes in bf16")
        print("GPT: ours vs native, alternating ...", flush=True)
        gpt_end = time.monotonic() + GPT2_SHARE * max(end - time.monotonic(), 0.0)
        report["gpt2"] = guarded(report, "gpt2", lambda: gpt2_section(template, desc, sizes, device, args.rounds,
                                                                      gpt_end))
        del template
    print("Linear stack: fp8-mixed vs bf16-mixed ...", flush=True)
    report["linear_fp8"] = guarded(report, "linear_fp8", lambda: linear_section(sizes, device, args.rounds, end))
    report["wall_s"] = time.monotonic() - start
    text = markdown(report)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "gpu_check.md").write_text(text)
    print("\n" + text)
    print(f"written: {args.out / 'gpu_check.json'}, {args.out / 'gpu_check.md'}")
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
