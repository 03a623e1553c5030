"""Checkpoints: the plugin's record, resume across recipes, file errors.

The concept (the core's :mod:`mp_callbacks.loss_scale` record and :mod:`mp_callbacks.recipes` resume plan):
everything the plugin puts into a checkpoint is plain data under a schema tag and version (loads with
``torch.load(..., weights_only=True)``); a state of another schema or recipe is an error naming both (and
the file, when known); under another recipe, opt-in, the masters where both keep them.  The rules here:
:func:`plugin_record` (what ``MixedPrecision.state_dict`` writes); a ``*-master`` checkpoint's model weights
are the FP32 masters; :class:`CheckedCheckpointIO` checks a file before torch reads it
(:class:`CheckpointFileError`).
"""

from .files import CheckedCheckpointIO, CheckpointFileError, check_checkpoint_file, loaded_from
from .record import PLUGIN_SCHEMA, PLUGIN_SCHEMA_VERSION, plugin_record

__all__ = ["PLUGIN_SCHEMA", "PLUGIN_SCHEMA_VERSION", "CheckedCheckpointIO", "CheckpointFileError",
           "check_checkpoint_file", "loaded_from", "plugin_record"]
