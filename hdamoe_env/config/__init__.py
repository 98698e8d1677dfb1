"""Configuration: errors, specs, convention profiles, file I/O and the run configuration.

What lives here: the typed errors of the package (``errors``), the frozen model / hardware /
topology specs and their presets (``specs``, paper-model.md §2–3), the convention profiles
(``profiles``, §4), atomic file writes and JSON helpers (``fileio``), the bounded process-wide
cache helper (``cache``) and the one run configuration resolved at the boundary (``run``).
Nothing here simulates anything.

May import: traces
"""
