"""tests/gpu needs a CUDA GPU: without one every test here is skipped (not failed,
not silently dropped), and every test here carries the `gpu` marker."""
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # a broken torch install is also "no GPU" for this folder
        return False


def pytest_collection_modifyitems(config, items):
    # Collection hooks see the whole session's items: touch only this folder's.
    mine = [it for it in items if os.path.abspath(str(it.fspath)).startswith(HERE + os.sep)]
    if not mine:
        return
    skip = None if _cuda_available() else pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu)")
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)
