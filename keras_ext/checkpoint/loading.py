"""Loading what keras_ext saved: :func:`load_model`, :func:`load_weights`, and errors that say what is wrong.

:func:`load_model` is ``keras.models.load_model`` with keras_ext's steps between building and loading:

1. the archive is checked (:class:`SavedFileError`: missing, truncated, not a Keras archive);
2. the model is built from its config (:func:`keras_ext.layers.loading_scope`);
3. :func:`restore`: each sublayer gets its saved policy (:class:`~keras_ext.policy.PolicyMap`), FP8 layers
   their FP8 calls and variables (:func:`keras_ext.fp8.restore`), composites the casts at their boundaries
   (:func:`keras_ext.policy.install_casts`), and ``compile`` its recipe check (:mod:`keras_ext.policy.guard`);
4. it is compiled from the saved compile config (also for models whose ``compile`` is their own, such as
   keras_hub tasks, which Keras then leaves uncompiled) and the optimizer is built on every variable,
   FP8 state included;
5. the weights and the optimizer state (masters, slots, step count, scaler) are loaded: the continued run
   equals the uninterrupted one, after any number of round trips.

:func:`load_weights` builds a compiled model's optimizer before loading (Keras skips the optimizer's state,
with a warning, when its optimizer is not built yet: the step count restarted).
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

import keras

from mp_callbacks.policy import PolicyError

from ..fp8 import is_fp8_variable
from ..fp8 import restore as restore_fp8
from ..layers import loading_scope, own_variables, resolved_policy, walk
from ..policy import MODEL_OUTPUT, PolicyMap, guard_compile, install_casts

__all__ = ["SavedFileError", "check_keras_archive", "check_weights_file", "load_model", "load_weights", "restore"]

_HDF5 = b"\x89HDF\r\n\x1a\n"


class SavedFileError(ValueError):
    """A saved model or weights file that cannot be what it claims: missing, truncated, or of another kind."""


def _head(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(8)


def _exists(path: str, kind: str) -> int:
    if not os.path.exists(path):
        raise SavedFileError(f"{path}: no such file (expected {kind})")
    if os.path.isdir(path):
        raise SavedFileError(f"{path} is a directory, not {kind}")
    return os.path.getsize(path)


def check_keras_archive(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config of the ``.keras`` archive at ``path``; :class:`SavedFileError` naming what is wrong otherwise."""
    path = os.fspath(path)
    size = _exists(path, "a .keras archive")
    if not zipfile.is_zipfile(path):
        head = _head(path)
        if head.startswith(b"PK"):
            raise SavedFileError(f"{path} ({size} bytes) is a truncated .keras archive: it starts as one, but the "
                                 "zip directory at its end is missing (an interrupted save or copy)")
        if head == _HDF5:
            raise SavedFileError(f"{path} is an HDF5 file, not a .keras archive: a weights file (load it with "
                                 "keras_ext.load_weights(model, path)) or a legacy .h5 model")
        raise SavedFileError(f"{path} ({size} bytes) is not a .keras archive (a zip holding config.json and "
                             "model.weights.h5)")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        if "config.json" not in names:
            raise SavedFileError(f"{path} is a zip archive but not a Keras model: it holds {names[:8]}, no "
                                 "config.json")
        if not any(n.startswith("model.weights.") for n in names):
            raise SavedFileError(f"{path} holds a Keras config but no weights (model.weights.h5)")
        bad = archive.testzip()
        if bad is not None:
            raise SavedFileError(f"{path} is corrupted: the archive member {bad!r} fails its checksum")
        try:
            return json.loads(archive.read("config.json"))
        except ValueError as exc:
            raise SavedFileError(f"{path}: config.json is not valid JSON ({exc})") from None


def check_weights_file(path: str | os.PathLike[str]) -> None:
    """:class:`SavedFileError` unless ``path`` is a complete HDF5 weights file (or a ``.keras`` archive)."""
    path = os.fspath(path)
    if path.endswith(".keras"):
        check_keras_archive(path)
        return
    size = _exists(path, "a weights file")
    if _head(path) != _HDF5:
        kind = "a .keras archive (load it with keras_ext.load_model)" if zipfile.is_zipfile(path) else "not HDF5"
        raise SavedFileError(f"{path} ({size} bytes) is not a weights file: it is {kind}")
    import h5py

    try:
        h5py.File(path, "r").close()
    except OSError as exc:
        raise SavedFileError(f"{path} ({size} bytes) is a damaged or truncated weights file: {exc}") from None


def restore(model: Any, recipe: Any = None) -> Any:
    """What Keras cannot rebuild from a config (see the module docstring, step 3); returns ``model``."""
    seen: set[int] = set()
    for path, owner in [("", model), *walk(model)]:
        saved = owner.dtype_policy
        if not isinstance(saved, PolicyMap) or id(saved) in seen:  # its sublayers share their owner's map
            continue
        seen.add(id(saved))
        subs = list(walk(owner))
        if [c for _, c, _, _ in saved.layers] != [type(s).__name__ for _, s in subs]:
            raise PolicyError(f"{path or type(owner).__name__} was saved with sublayers "
                              f"{[c for _, c, _, _ in saved.layers]} and rebuilt with "
                              f"{[type(s).__name__ for _, s in subs]}: the saved policies do not fit")
        for (_, _, kp, out), (_, sub) in zip(saved.layers, subs):
            sub.dtype_policy = kp
            if out is not None:
                object.__setattr__(sub, MODEL_OUTPUT, out)
        if saved.outputs is not None:
            object.__setattr__(owner, MODEL_OUTPUT, saved.outputs)
        saved.bind(owner)
    wrong = [f"{v.path} ({v.dtype})" for _, layer in walk(model) for v in own_variables(layer)
             if keras.backend.is_float_dtype(keras.backend.standardize_dtype(v.dtype)) and not is_fp8_variable(v)
             and keras.backend.standardize_dtype(v.dtype) != resolved_policy(layer).variable_dtype]
    if wrong:
        raise PolicyError(f"these variables were rebuilt in other dtypes than their saved policies: {wrong}")
    restore_fp8(model)
    install_casts(model)
    if recipe is not None:
        guard_compile(model, recipe)
    return model


def _compile(model: Any, config: dict[str, Any], custom_objects: Any) -> None:
    with loading_scope():
        kwargs = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
    model.compile(**kwargs)
    if getattr(model, "optimizer", None) is not None and model.built:
        model.optimizer.build(model.trainable_variables)


def _load_state(model: Any, path: str) -> None:
    """The weights and optimizer state (and assets) of the archive, as ``keras.models.load_model`` loads them."""
    from keras.src.saving import saving_lib

    with zipfile.ZipFile(path) as archive:
        weights = saving_lib.H5IOStore(saving_lib._VARS_FNAME_H5, archive=archive, mode="r")
        assets = None
        if any(n.startswith(saving_lib._ASSETS_DIRNAME + "/") for n in archive.namelist()):
            assets = saving_lib.DiskIOStore(saving_lib._ASSETS_DIRNAME, archive=archive, mode="r")
        failed: set[int] = set()
        errors: dict[int, Any] = {}
        try:
            saving_lib._load_state(model, weights_store=weights, assets_store=assets, inner_path="",
                                   visited_saveables=set(), failed_saveables=failed, error_msgs=errors)
        finally:
            weights.close()
            if assets is not None:
                assets.close()
    if failed:
        first = next(iter(errors.values()))
        raise SavedFileError(f"{path}: {len(errors)} objects of the model did not match the saved state "
                             f"(the file holds another model, or was saved before keras_ext.apply_policy); "
                             f"{first[0].name if hasattr(first[0], 'name') else first[0]}: {first[1]}")


def _saved_recipe(model: Any) -> Any:
    opt = getattr(model, "optimizer", None)
    return getattr(opt, "recipe", None) if opt is not None else None


def load_model(filepath: str | os.PathLike[str], custom_objects: Any = None, compile: bool = True,
               safe_mode: bool = True) -> keras.Model:
    """A model saved with ``model.save`` / :func:`keras_ext.save_model`, with its nested policies, FP8 state and
    optimizer state (see the module docstring); ``keras.models.load_model``'s arguments."""
    path = os.fspath(filepath)
    config = check_keras_archive(path)
    compile_config = config.get("compile_config") if compile else None
    config["compile_config"] = None
    from keras.src.saving.serialization_lib import ObjectSharingScope

    with loading_scope(), ObjectSharingScope():
        model = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects, safe_mode=safe_mode)
    restore(model)
    if compile_config:
        _compile(model, compile_config, custom_objects)
        guard_compile(model, _saved_recipe(model))
    _load_state(model, path)
    return model


def load_weights(model: Any, filepath: str | os.PathLike[str], skip_mismatch: bool = False) -> None:
    """``model.load_weights(filepath)`` after building a compiled model's optimizer (so that its state, masters
    and step count included, is loaded); a missing, truncated or foreign file is a :class:`SavedFileError`."""
    check_weights_file(filepath)
    opt = getattr(model, "optimizer", None)
    if opt is not None and model.built and not opt.built:
        opt.build(model.trainable_variables)
    try:
        model.load_weights(filepath, skip_mismatch=skip_mismatch)
    except ValueError as exc:
        raise SavedFileError(f"{os.fspath(filepath)} does not fit this model (another architecture, or saved "
                             f"before/after keras_ext.apply_policy changed it): {exc}") from exc
