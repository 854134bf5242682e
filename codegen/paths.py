"""Where dsgraph's data folders are: templates/ and model_specs/.

In a checkout they are top-level folders beside the packages.  A wheel has no
repository root, so pyproject.toml installs them inside this package
(codegen/templates, codegen/model_specs); the installed copy wins when present.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
REPO_ROOT = _PACKAGE.parent


def data_dir(name: str) -> Path:
    installed = _PACKAGE / name
    return installed if installed.is_dir() else REPO_ROOT / name


TEMPLATES_DIR = data_dir("templates")
MODEL_SPECS_DIR = data_dir("model_specs")
# What `dsgraph compile` and `dsgraph generate --random-weights` build when given no spec.
DEFAULT_SPEC = MODEL_SPECS_DIR / "deepseek_v2_lite.yaml"
