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


def pytest_report_header(config):
    try:
        from harness import EXAMPLES_SCALE, RUN_SEED
    except Exception:  # no torch: the folder is skipped anyway
        return None
    return (f"dsgraph kernel tests: hypothesis seed {RUN_SEED} (replay: DSGRAPH_TEST_SEED={RUN_SEED}), "
            f"examples x{EXAMPLES_SCALE:g} (DSGRAPH_EXAMPLES_SCALE)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and os.path.abspath(str(item.fspath)).startswith(HERE + os.sep):
        try:
            from harness import RUN_SEED
            report.sections.append(("dsgraph seed", f"replay with DSGRAPH_TEST_SEED={RUN_SEED}"))
        except Exception:
            pass
