"""Saving, loading and resuming keras_ext runs.

Everything keras_ext puts into a file is plain data (variables, numbers, strings, registered configs), so
``.keras`` files load with ``safe_mode=True`` where keras_ext is imported, and every save idiom resumes exactly:

* :func:`save_model` / :func:`save_weights`: the FP32 masters as the saved weights; :func:`export_fp32` /
  :func:`fp32_values`: the FP32 values of a run;
* :func:`load_model` / :func:`load_weights`: nested policies, FP8 state and the optimizer state (masters, slots,
  step count, scaler) back, any number of round trips; :class:`SavedFileError` for missing, truncated or
  foreign files;
* :func:`resume`: continue a saved run, also under another recipe or from Keras' own optimizers (opt-in).
"""

from .loading import SavedFileError, check_keras_archive, check_weights_file, load_model, load_weights, restore
from .resume import resume
from .saving import export_fp32, fp32_values, masters_of, save_model, save_weights

__all__ = ["SavedFileError", "check_keras_archive", "check_weights_file", "export_fp32", "fp32_values", "load_model",
           "load_weights", "masters_of", "resume", "restore", "save_model", "save_weights"]
