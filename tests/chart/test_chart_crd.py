"""The chart carries the CRD of crds/ and no second copy that could drift: the chart's file is a
symlink to it, and what `helm package` ships and `helm template --include-crds` renders is it."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

import yaml
from chartkit import CHART, CRD_SOURCE, run_helm

CHART_CRD = CHART / "crds" / CRD_SOURCE.name
CRD_NAME = "kvcachepools.kvpool.dev"


def test_chart_crd_is_a_link_to_the_source() -> None:
    assert CRD_SOURCE.is_file()
    assert CHART_CRD.is_symlink(), "the chart must link to crds/, not hold a copy"
    assert CHART_CRD.resolve() == CRD_SOURCE.resolve()


def test_packaged_chart_carries_the_source_bytes(helm: Path, tmp_path: Path) -> None:
    result = run_helm("package", str(CHART), "--destination", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (package,) = tmp_path.glob("kvpool-*.tgz")
    with tarfile.open(package) as tar:
        member = tar.getmember(f"kvpool/crds/{CRD_SOURCE.name}")
        assert member.isfile(), "helm package must follow the symlink and store the file itself"
        assert (stored := tar.extractfile(member)) is not None and stored.read() == CRD_SOURCE.read_bytes()
        others = [m.name for m in tar.getmembers() if m.isfile() and m.name != member.name]
        for name in others:
            f = tar.extractfile(name)
            assert f is not None
            data = f.read()
            assert not (b"CustomResourceDefinition" in data and b"KVCachePool" in data), (
                f"{name} defines the CRD again"
            )


def test_rendered_crd_is_the_source(rendered: Callable) -> None:
    crds = [
        o
        for o in rendered(None)
        if o["kind"] == "CustomResourceDefinition" and o["metadata"]["name"] == CRD_NAME
    ]
    assert crds == [yaml.safe_load(CRD_SOURCE.read_text())]
