"""The functional core: specs, diffs, hashes and the pure `reconcile()`.

Nothing in this package does I/O: no files, no processes, no network, no
clock. An import-linter contract in pyproject.toml keeps it that way.
"""
