"""Checkpoint files: checked before torch reads them, and known by the entries they held.

:func:`check_checkpoint_file` (and :class:`CheckedCheckpointIO`, Lightning's ``TorchCheckpointIO`` that
calls it, for the Trainer and Fabric) turns a missing, truncated or foreign file into a
:class:`CheckpointFileError` naming the file, what is wrong and what to do, instead of torch's
``PytorchStreamReader failed reading zip archive``.  :func:`loaded_from` names the file a state the plugin
refuses came from under Fabric (the Trainer names its ``ckpt_path``).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

__all__ = ["CheckedCheckpointIO", "CheckpointFileError", "check_checkpoint_file", "loaded_from"]

_EARLIER = ("resume from an earlier checkpoint (ModelCheckpoint keeps last.ckpt and the top-k), or save this one "
            "again")


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be loaded: missing, truncated, or not a torch checkpoint."""


def check_checkpoint_file(path: str | os.PathLike[str]) -> None:
    """:class:`CheckpointFileError` unless ``path`` is a complete ``torch.save`` file (a zip archive holding
    ``data.pkl``, or the legacy pickle format); a directory (a sharded checkpoint) or a remote URL is left to
    its loader."""
    path = os.fspath(path)
    if "://" in path or os.path.isdir(path):
        return
    if not os.path.exists(path):
        raise CheckpointFileError(f"{path}: no such checkpoint file (check the path, or ModelCheckpoint's dirpath)")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except zipfile.BadZipFile as exc:
            raise CheckpointFileError(f"{path} ({size} bytes) is a truncated or damaged checkpoint: it starts as "
                                      f"torch.save's zip archive but cannot be read ({exc}; was the save "
                                      f"interrupted?); {_EARLIER}") from None
        if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            raise CheckpointFileError(f"{path} is a zip archive but not a torch checkpoint (it holds {names[:6]}, no "
                                      "data.pkl); pass the .ckpt file Lightning saved")
    elif not head.startswith(b"\x80"):  # neither zip nor the legacy pickle format
        kind = "an HDF5 file (Keras weights?)" if head.startswith(b"\x89HDF") else f"starts with {head!r}"
        what = "empty" if size == 0 else f"not a torch checkpoint: {kind}"
        raise CheckpointFileError(f"{path} ({size} bytes) is {what}; {_EARLIER}")


class CheckedCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` that checks the file first (:func:`check_checkpoint_file`):
    ``Trainer(plugins=[MixedPrecision(...), CheckedCheckpointIO()])`` or ``Fabric(plugins=[...])``.  The
    entries of the checkpoint it read last are known by the file (:func:`loaded_from`)."""

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        check_checkpoint_file(path)
        try:
            checkpoint = super().load_checkpoint(path, *args, **kwargs)
        except (RuntimeError, EOFError, OSError) as exc:  # torch's reader: damaged past the checks above
            raise CheckpointFileError(f"{os.fspath(path)} cannot be read as a torch checkpoint "
                                      f"({type(exc).__name__}: {str(exc).splitlines()[0]}); {_EARLIER}") from exc
        _LAST_READ[:] = [(path, {id(v): _fingerprint(v) for v in checkpoint.values() if isinstance(v, Mapping)})]
        return checkpoint


_LAST_READ: list[tuple[Any, dict[int, Any]]] = []
"""``[(file, {id(entry): fingerprint})]`` of the mappings in the checkpoint :class:`CheckedCheckpointIO` read last
(no reference kept: a master weights record is as large as the model)."""


def _fingerprint(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(map(str, entry))), entry.get("recipe"), entry.get("schema_version")


def loaded_from(state_dict: Any) -> Any:
    """The file :class:`CheckedCheckpointIO` read ``state_dict`` from (an entry of the last checkpoint it read,
    known by identity and keys), or None."""
    for path, entries in _LAST_READ:
        known = entries.get(id(state_dict))
        if known is not None and isinstance(state_dict, Mapping) and known == _fingerprint(state_dict):
            return path
    return None


