"""One Trainer optimizer step reads like Lightning's own ``MixedPrecision.optimizer_step`` (``amp.py``): the plugin
(``trainer.py``/``fabric.py``, the hub) runs the closure, then calls each collaborator in turn (the weight
store, the loss scaler, the step, the update), and no collaborator hands the step to another project file and is
entered again afterwards (no ping-pong between collaborators).

The record (``sys.setprofile``, in this test only): from the plugin's ``optimizer_step`` to its return, the
Lightning closure (forward and backward) left out, every call that enters a ``lightning_ext`` file from another
``lightning_ext`` file: ``(file entered, file it was entered from)``.  The rule: apart from the hub, a file is
never entered again once it has called into another project file.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_ext import MixedPrecision
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

PACKAGE = os.path.dirname(os.path.abspath(sys.modules["lightning_ext"].__file__))
HUB = {"trainer.py", "fabric.py", "plugin.py"}
"""The plugin's files: the step's hub (``plugin.py``: the Trainer plugin's name before the regrouping)."""


def _ours(frame: FrameType | None) -> str | None:
    """The ``lightning_ext`` file (relative path) ``frame`` runs in, else None."""
    if frame is None:
        return None
    path = os.path.abspath(frame.f_code.co_filename)
    return os.path.relpath(path, PACKAGE) if path.startswith(PACKAGE + os.sep) else None


class StepPath:
    """Records the entries of one ``optimizer_step`` of the Trainer plugin (see the module docstring)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str]] = []
        self._step: FrameType | None = None
        self._closure: FrameType | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "return":
            if frame is self._closure:
                self._closure = None
            elif frame is self._step:
                self._step = None
            return
        if event != "call":
            return
        code = frame.f_code
        if self._step is None:
            if code.co_name == "optimizer_step" and _ours(frame) in HUB and not self.entries:
                self._step = frame
            return
        if self._closure is not None:
            return
        if code.co_name == "__call__" and code.co_filename.endswith(os.path.join("optimization", "automatic.py")):
            self._closure = frame  # Lightning's closure: the forward and backward
            return
        here = _ours(frame)
        if here is None:
            return
        caller = frame.f_back
        while caller is not None and _ours(caller) is None:
            caller = caller.f_back
        source = _ours(caller)
        if source is not None and source != here:
            self.entries.append((here, source))

    def violations(self) -> list[str]:
        """Entries into a non-hub file that had called into another project file before."""
        left: set[str] = set()
        out = []
        for i, (here, source) in enumerate(self.entries):
            if here not in HUB and here in left:
                out.append(f"#{i}: {source} -> {here}, which had called into another project file")
            if source not in HUB:
                left.add(source)
        return out

    def stops(self) -> dict[str, int]:
        """Stops (entries, repeated calls from the same file in a row counted once), distinct files, entries into
        a non-hub file entered before (from the hub or not), and those after it had called into another file."""
        runs = [e for i, e in enumerate(self.entries) if i == 0 or self.entries[i - 1] != e]
        seen: set[str] = set()
        again = 0
        for here, _ in runs:
            again += here in seen and here not in HUB
            seen.add(here)
        return {"stops": len(runs), "files": len(seen), "re-entered": again, "ping-pong": len(self.violations())}


class _Record(pl.Callback):
    """Profiles the optimizer step of batch ``at`` (earlier batches: the warm-up)."""

    def __init__(self, at: int) -> None:
        self.at, self.path = at, StepPath()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            sys.setprofile(self.path)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx == self.at:
            sys.setprofile(None)


def record_step(recipe: str) -> StepPath:
    """The entries of one ``recipe`` Trainer step after two warm-up steps (AdamW, a LayerNorm kept in FP32)."""
    record = _Record(at=2)
    plugin = MixedPrecision(recipe, scaler={"init_scale": 2.0**8} if recipe.startswith("16") else None)
    model = TinyRegressor(optimizer="adamw", norm=True)
    try:
        pl.Trainer(plugins=[plugin], callbacks=[record], max_steps=3, **trainer_kwargs()).fit(model, loader())
    finally:
        sys.setprofile(None)
    return record.path


@pytest.mark.parametrize("recipe", ["bf16-master", "16-mixed"])
def test_the_step_enters_each_collaborator_from_the_plugin(recipe):
    path = record_step(recipe)
    sequence = "\n".join(f"  {source} -> {here}" for here, source in path.entries)
    assert path.entries, "nothing recorded: the plugin's optimizer_step was not seen"
    assert not path.violations(), f"{path.violations()}\nthe step's entries ({path.stops()}):\n{sequence}"
    files = {here for here, _ in path.entries}
    assert "loss_scale/scaler.py" in files, sequence  # the recording saw the step's collaborators
    if recipe == "bf16-master":
        assert "weights/masters.py" in files, sequence


if __name__ == "__main__":  # the stop counts of the tree on the path: python tests/lightning/test_step_path.py
    for name in ("bf16-master", "16-mixed"):
        steps = record_step(name)
        print(name, steps.stops())
        print("\n".join(f"  {source} -> {here}" for here, source in steps.entries))
