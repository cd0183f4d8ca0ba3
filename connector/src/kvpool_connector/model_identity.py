"""The identity of a model's weights, beyond its name or path, for the chunk namespace.

A rolling upgrade that puts new weights at the same path (or a hub name whose branch moved) must
never load the old model's KV from the shared tier. Hashing every byte of a 140 GB model at start-up
is too slow, so the fingerprint covers, per weight file: its name and size, a safetensors file's
whole header (tensor names, dtypes, shapes, offsets), and 16 evenly spaced 64 KiB windows of its
bytes (about 1 MiB read per file); plus config.json and the other small JSON files whole. New
weights change every window; a change that touches none of the windows (one tensor edited in place)
is not seen: deployers who do that pin `model_fingerprint` in the connector config instead.

Weights it cannot read (streamed from object storage, where vLLM keeps only the configs locally; a
snapshot it cannot find) fail closed: the engine's keys get a random generation of their own, so
its chunks are never shared across pods by a name alone, whose weights may differ.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from .logs import connector_logger

if TYPE_CHECKING:
    from vllm.config import ModelConfig

log = connector_logger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".msgpack", ".h5", ".npz")
PRIVATE_WEIGHTS = "private:"  # an identity of this engine's own: its chunks are never shared
WINDOWS = 16
WINDOW_BYTES = 64 * 1024
_MAX_SAFETENSORS_HEADER = 100 * 2**20


def _sample(path: Path, size: int, h: hashlib.blake2b) -> None:
    with path.open("rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            n = int.from_bytes(f.read(8), "little")
            if n <= min(size - 8, _MAX_SAFETENSORS_HEADER):
                h.update(f.read(n))
        span = max(0, size - WINDOW_BYTES)
        for i in range(WINDOWS):
            f.seek(span * i // (WINDOWS - 1))
            h.update(f.read(WINDOW_BYTES))


def file_fingerprint(path: Path) -> str:
    """The fingerprint of a single-file model (a GGUF file), as weights_fingerprint's of one file."""
    h = hashlib.blake2b(digest_size=16, person=b"kvpool-weights")
    size = path.stat().st_size
    h.update(f"{path.name}\x1f{size}\x1e".encode())
    _sample(path, size, h)
    return h.hexdigest()


def _has_weights(model_dir: Path) -> bool:
    return any(p.suffix in WEIGHT_SUFFIXES and p.is_file() for p in model_dir.rglob("*"))


def weights_fingerprint(model_dir: Path) -> str:
    """A 32-hex-digit digest of the weights and configuration files in `model_dir` (see above)."""
    h = hashlib.blake2b(digest_size=16, person=b"kvpool-weights")
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir).as_posix()
        weight = path.suffix in WEIGHT_SUFFIXES
        if not weight and path.suffix != ".json":
            continue
        size = path.stat().st_size
        h.update(f"{rel}\x1f{size}\x1e".encode())
        if weight:
            _sample(path, size, h)
        elif size <= 16 * 2**20:  # config.json, the safetensors index, adapter_config.json
            h.update(path.read_bytes())
    return h.hexdigest()


def _local_dir(model: ModelConfig, download_dir: str | None) -> Path | None:
    path = Path(str(model.model))
    if path.is_dir():
        return path
    try:  # a hub name: vLLM has downloaded its snapshot (into --download-dir, if given) already
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                str(model.model), revision=model.revision, local_files_only=True, cache_dir=download_dir
            )
        )
    except Exception as e:  # not in the local hub cache, or no huggingface_hub
        log.debug("kvpool: no local snapshot of %s: %r", model.model, e)
        return None


def model_weights_identity(
    model: ModelConfig, pinned: str | None = None, download_dir: str | None = None
) -> str:
    """What the namespace names the weights by: a pinned fingerprint, else the files' fingerprint
    (a hub snapshot's directory is its commit, so that is covered too), else a generation of this
    engine's own."""
    if pinned:
        return f"pinned:{pinned}"
    streamed = getattr(model, "model_weights", "")  # object storage: only the configs are local
    path = Path(str(model.model))
    if not streamed and path.is_file():
        return f"file:{file_fingerprint(Path(os.path.realpath(path)))}"
    directory = None if streamed else _local_dir(model, download_dir)
    if directory is not None and _has_weights(directory):
        return f"files:{weights_fingerprint(Path(os.path.realpath(directory)))}"
    log.warning(
        "kvpool: cannot read the weights of %s to fingerprint them: this engine's chunks are keyed "
        "by a generation of its own and never shared with other pods (new weights under the same "
        "name would load the old KV). To share them, set model_fingerprint in "
        "kv_connector_extra_config to a name for exactly these weights (e.g. their version)",
        streamed or model.model,
    )
    return f"{PRIVATE_WEIGHTS}{secrets.token_hex(16)}"
