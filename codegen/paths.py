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


def shipped_specs() -> list[str]:
    """The names of the specs shipped with dsgraph (model_specs/*.yaml): what spec_path accepts."""
    return sorted(p.stem for p in MODEL_SPECS_DIR.glob("*.yaml"))


# How a spec argument is written, in every command's and the API's help: one wording.
SPEC_ARGUMENT = "a spec YAML file, or the name of a shipped spec"


def looks_like_hub_id(text: str) -> bool:
    """'org/name' (a Hugging Face Hub id) rather than a local path: one slash, no file suffix."""
    import re
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text)) and not text.endswith((".yaml", ".yml", ".json"))


def hub_hint(text: str) -> str:
    """What to do with a Hub id where dsgraph wants a local folder."""
    return (f"{text} looks like a Hugging Face Hub id, but dsgraph reads local folders: download it with "
            f"`huggingface-cli download {text} --local-dir DIR` and pass DIR")


def missing_model_folder(model_dir) -> str | None:
    """Why `model_dir` is not a checkpoint folder (with what to do), or None when it is a folder."""
    text = str(model_dir)
    path = Path(model_dir)
    if path.is_dir():
        return None
    if path.is_file():
        hint = (f"; to write a spec from a config.json: dsgraph spec --from-config {text}"
                if text.endswith(".json") else "")
        return f"{text} is a file; give the checkpoint folder that holds config.json and the *.safetensors{hint}"
    if looks_like_hub_id(text):
        return f"model folder {text} does not exist; {hub_hint(text)}"
    return f"model folder {text} does not exist; give a checkpoint folder (config.json and *.safetensors)"


def spec_path(spec) -> Path:
    """The YAML file a spec argument names: an existing path as given, else a shipped spec by its name
    ("deepseek_tiny"), file name or checkout path ("model_specs/deepseek_tiny.yaml"), found from any
    folder and inside a wheel.  Anything else is one SpecNotFoundError saying what it could be."""
    from ir.errors import SpecNotFoundError, did_you_mean
    path = Path(spec)
    if path.exists():
        return path
    names = shipped_specs()
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    if stem in names and (len(path.parts) == 1 or path.parent.as_posix() == "model_specs"):
        return MODEL_SPECS_DIR / f"{stem}.yaml"
    text = str(spec)
    hint = f"; {hub_hint(text)}" if looks_like_hub_id(text) else did_you_mean(stem, names)
    raise SpecNotFoundError(f"spec file not found: {text} ({SPEC_ARGUMENT}: {', '.join(names)}){hint}", file=text)
