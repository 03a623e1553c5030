"""The ``mpx`` application: compare, demo, report, measurement, machine probe, FP8 report.

It sits above both adapters: the only code of the project that imports them (its runners,
:mod:`.lightning_runner` and :mod:`.keras_runner`, each loaded only when its framework runs).
Its modules are imported by name; this package exports nothing.
"""

