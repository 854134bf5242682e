"""Shared test setup: the repository root goes on sys.path so the suite runs
straight from a checkout (the GPU machine cannot pip-install)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
