"""The weights' identity in the namespace covers the ways vLLM finds weights, and fails closed where it
cannot read them: new weights under the same name never share keys with the old ones."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvpool_connector.model_identity import model_weights_identity


def _model(model: str | Path, weights: str = "") -> Any:
    """The fields of vLLM's ModelConfig the identity reads (model_weights: an object-storage URI)."""
    return SimpleNamespace(model=str(model), revision=None, model_weights=weights)


def test_a_single_file_model_is_fingerprinted_by_its_bytes(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    seen = set()
    for _ in range(2):
        gguf.write_bytes(os.urandom(1 << 16))  # new weights at the same path
        identity = model_weights_identity(_model(gguf))
        assert identity.startswith("file:")
        assert identity == model_weights_identity(_model(gguf))  # stable for the same bytes
        seen.add(identity)
    assert len(seen) == 2


def test_a_hub_snapshot_in_the_download_dir_is_fingerprinted(tmp_path: Path) -> None:
    """`vllm serve org/model --download-dir D`: the snapshot is in D, not the default cache."""
    download_dir = tmp_path / "download-dir"
    repo = download_dir / "models--org--model"
    seen = set()
    for commit in ("a" * 40, "b" * 40):  # the branch moved to a new commit
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps({"commit": commit}))
        (snapshot / "model.safetensors").write_bytes(os.urandom(1 << 16))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        identity = model_weights_identity(_model("org/model"), download_dir=str(download_dir))
        assert identity.startswith("files:")
        seen.add(identity)
    assert len(seen) == 2


def test_weights_it_cannot_read_are_never_shared_by_name(tmp_path: Path) -> None:
    # streamed from object storage: vLLM pulls only the configs into a local directory
    configs = tmp_path / "model_streamer" / "0123abcd"
    configs.mkdir(parents=True)
    (configs / "config.json").write_text("{}")
    streamed = [model_weights_identity(_model(configs, "s3://bucket/model/")) for _ in range(2)]
    # a directory without weight files, and a hub name with no local snapshot
    bare = [model_weights_identity(_model(configs)) for _ in range(2)]
    unknown = [model_weights_identity(_model("org/not-downloaded")) for _ in range(2)]
    for pair in (streamed, bare, unknown):
        assert all(i.startswith("private:") for i in pair)
        assert pair[0] != pair[1]  # two engines never share keys
    assert model_weights_identity(_model(configs, "s3://bucket/model/"), pinned="v7") == "pinned:v7"
