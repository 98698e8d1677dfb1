"""Configuration: errors, specs, convention profiles, file I/O and the run configuration.

What lives here: the typed errors of the package (``errors``), the frozen model / hardware /
topology specs and their presets (``specs``, paper-model.md §2–3), the convention profiles
(``profiles``, §4), the credible ranges of its judgement knobs (``uncertainty``), atomic file writes and JSON helpers (``fileio``) and the one bounded
process-wide cache helper every memo table of the package uses (``cache``: ``BoundedCache``,
the registry ``CACHES``, ``clear_caches``) and the one run configuration: every option of a run
declared once and resolved once at the boundary (``run``: ``RUN_OPTIONS``, ``RunSpec``).
Nothing here simulates anything.

May import: traces
"""
