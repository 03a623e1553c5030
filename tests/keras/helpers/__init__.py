"""Helpers of the Keras adapter tests: ``util`` (paths, markers, subprocess runner), ``models``
(small models and data), ``stock_parity`` (a fit with stock Keras' and our LossScaleOptimizer),
and the scripts run in fresh processes (``python -m tests.keras.helpers.<name>``): ``mirrored``,
``monitor_backend``.  Importing this package imports no framework (the scripts must configure
TensorFlow before it starts)."""
