"""keras_ext/checkpoint/loading.py: errors that say what happened (missing, truncated, foreign files; another model's
weights), the save_weights route keeping the optimizer state, and checkpoints of Keras' own optimizers
resumed under a keras_ext recipe (opted in, like any recipe change)."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

import keras_ext  # noqa: E402
from keras_ext import SavedFileError  # noqa: E402
from mp_callbacks import PolicyError  # noqa: E402
from mp_callbacks.settings import StateDictError  # noqa: E402


def _model(recipe="bf16-mixed", width=3):
    keras_ext.set_global_policy(recipe)
    keras.utils.set_random_seed(0)
    inp = keras.Input((2, 4))
    h = keras.layers.MultiHeadAttention(2, 2, name="mha")(inp, inp)  # a composite: saved with a PolicyMap
    out = keras.layers.Dense(1, name="head")(keras.layers.Dense(width, name="mid")(keras.layers.Flatten()(h)))
    model = keras_ext.apply_policy(keras.Model(inp, out))
    model.compile(keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe), "mse", run_eagerly=True)
    return model


def _fit(model, n=2):
    x = np.random.default_rng(0).normal(size=(4, 2, 4)).astype("float32")
    for i in range(n):
        model.train_on_batch(x[2 * (i % 2):2 * (i % 2) + 2], np.ones((2, 1), "float32"))


def test_missing_truncated_and_foreign_archives_say_what_they_are(tmp_path):
    model = _model()
    _fit(model)
    path = tmp_path / "m.keras"
    keras_ext.save_model(model, path)
    data = path.read_bytes()
    half = tmp_path / "half.keras"
    half.write_bytes(data[: len(data) // 2])
    for load in (keras_ext.load_model, lambda p: keras_ext.resume(_model(), p)):
        with pytest.raises(SavedFileError, match=r"half.keras \(\d+ bytes\) is a truncated .keras archive"):
            load(half)
    with pytest.raises(SavedFileError, match="nothing.keras: no such file"):
        keras_ext.load_model(tmp_path / "nothing.keras")
    foreign = tmp_path / "foreign.keras"
    with zipfile.ZipFile(foreign, "w") as zf:
        zf.writestr("readme.txt", "not a model")
    with pytest.raises(SavedFileError, match=r"a zip archive but not a Keras model: it holds \['readme.txt'\]"):
        keras_ext.load_model(foreign)
    keras_ext.save_weights(model, tmp_path / "w.weights.h5")
    with pytest.raises(SavedFileError, match="an HDF5 file, not a .keras archive.*keras_ext.load_weights"):
        keras_ext.load_model(tmp_path / "w.weights.h5")
    text = tmp_path / "notes.keras"
    text.write_text("hello")
    with pytest.raises(SavedFileError, match=r"notes.keras \(5 bytes\) is not a .keras archive"):
        keras_ext.load_model(text)
    with pytest.raises(PolicyError, match="keras_ext.load_model"):
        keras.models.load_model(path)  # Keras' own loader names the one that can rebuild the casts


def test_weights_files_that_cannot_fit_say_why(tmp_path):
    model = _model()
    _fit(model)
    keras_ext.save_weights(model, tmp_path / "w.weights.h5")
    data = (tmp_path / "w.weights.h5").read_bytes()
    (tmp_path / "cut.weights.h5").write_bytes(data[: len(data) // 2])
    with pytest.raises(SavedFileError, match="damaged or truncated weights file"):
        keras_ext.load_weights(_model(), tmp_path / "cut.weights.h5")
    with pytest.raises(SavedFileError, match="does not fit this model"):
        keras_ext.load_weights(_model(width=5), tmp_path / "w.weights.h5")
    keras_ext.save_model(model, tmp_path / "m.keras")
    (tmp_path / "m.weights.h5").write_bytes((tmp_path / "m.keras").read_bytes())  # an archive, misnamed
    with pytest.raises(SavedFileError, match="not a weights file: it is a .keras archive"):
        keras_ext.load_weights(_model(), tmp_path / "m.weights.h5")


def test_the_save_weights_route_keeps_the_optimizer_state(tmp_path):
    """keras_ext.load_weights builds the optimizer before loading: slots, masters and the step count come back
    (Keras' own load_weights into an unbuilt optimizer skips them with a warning: the count restarted)."""
    model = _model("bf16-master")
    _fit(model, 3)
    keras_ext.save_weights(model, tmp_path / "w.weights.h5")
    mine = _model("bf16-master")
    keras_ext.load_weights(mine, tmp_path / "w.weights.h5")
    assert int(ops.convert_to_numpy(mine.optimizer.iterations)) == 3
    for a, b in zip(model.optimizer.variables, mine.optimizer.variables, strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    plain = _model("bf16-master")
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        plain.load_weights(tmp_path / "w.weights.h5")
    assert int(ops.convert_to_numpy(plain.optimizer.iterations)) == 0


@pytest.mark.parametrize("native_opt", ["loss_scale", "plain"])
def test_a_checkpoint_of_keras_own_optimizers_resumes_opted_in(tmp_path, native_opt):
    keras.config.set_dtype_policy("mixed_float16" if native_opt == "loss_scale" else "mixed_bfloat16")
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")])
    inner = keras.optimizers.Adam(1e-2)
    net.compile(keras.optimizers.LossScaleOptimizer(inner) if native_opt == "loss_scale" else inner, "mse")
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    net.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    net.save(tmp_path / "native.keras")
    keras.config.set_dtype_policy("float32")
    recipe = "16-mixed" if native_opt == "loss_scale" else "bf16-mixed"
    keras_ext.set_global_policy(recipe)
    keras.utils.set_random_seed(1)
    ours = keras_ext.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                                    keras.layers.Dense(1)]))
    ours.compile(keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe), "mse")
    kind = "LossScaleOptimizer" if native_opt == "loss_scale" else "Adam"
    with pytest.raises(StateDictError, match=f"saved with Keras' own {kind}.*Pass allow_recipe_change=True"):
        keras_ext.resume(ours, tmp_path / "native.keras")
    with pytest.warns(UserWarning, match="restarts"):
        plan = keras_ext.resume(ours, tmp_path / "native.keras", allow_recipe_change=True)
    assert plan.changes_recipe
    for a, b in zip(net.weights, ours.weights, strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(a, "float32")),
                                      ops.convert_to_numpy(ops.cast(b, "float32")))
    theirs = net.optimizer.inner_optimizer if native_opt == "loss_scale" else net.optimizer
    for a, b in zip(theirs.variables, ours.optimizer.inner_optimizer.variables, strict=True):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    steps = int(ops.convert_to_numpy(theirs.iterations))
    assert steps >= 1 and int(ops.convert_to_numpy(ours.optimizer.iterations)) == steps  # the count carried over
    ours.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    assert int(ops.convert_to_numpy(ours.optimizer.iterations)) == steps + 2 - ours.optimizer.skipped
