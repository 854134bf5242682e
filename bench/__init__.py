"""Timing and probe tools for developers (not part of the installed package): run from the
repository root as `python3 -m bench.<tool> --help`.  They time with runtime.timing, the measurement
code `dsgraph bench` uses, and build their one-op graphs with tests/gpu/harness.py."""
