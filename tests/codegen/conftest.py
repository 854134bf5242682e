"""tests/codegen: the SASS tests (test_sass_*.py) disassemble whole compiled kernels to pin their
machine code, seconds each; they run in the full suite, not the quick tier (`-m "not slow"`),
where test_nvrtc.py and the families' compile tests still compile kernels."""
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(tryfirst=True)   # before -m reads the markers
def pytest_collection_modifyitems(config, items):
    # Collection hooks see the whole session's items: touch only this folder's SASS tests.
    for item in items:
        path = os.path.abspath(str(item.fspath))
        if os.path.dirname(path) == HERE and os.path.basename(path).startswith("test_sass_"):
            item.add_marker(pytest.mark.slow)
