"""A connector of the user's own, in every shape vLLM reads one, as vLLM itself reads it.

Each pod goes through the webhook's decision; the admitted container's command line then goes
through what would run it: a real shell for `sh -c` scripts (with a stand-in `vllm` that prints the
argv it got), then vLLM's own `vllm serve` argument parser, which also reads `--config` files. The
property: when kvpool injects, vLLM runs kvpool's connector; when the user set one, the pod is admitted
untouched (OwnConnector) and vLLM runs the user's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool_operator.injection import decide
from kvpool_operator.pool import parse_pool
from kvpool_operator.settings import OperatorSettings

NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
NIXL_YAML = "kv-transfer-config:\n  kv_connector: NixlConnector\n  kv_role: kv_both\n"
SCRIPT = 'exec vllm serve /m {} "$@"'
CONFIG_DIR = "/etc/vllm"  # where the pods mount their ConfigMap; the test's files stand in for it

# shape -> (command, the --config file's text if any, the connector vLLM must run)
SHAPES: dict[str, tuple[list[str], str | None, str]] = {
    "none": (["vllm", "serve", "/m"], None, "KVPoolConnector"),
    "flag": (["vllm", "serve", "/m", "--kv-transfer-config", NIXL], None, "NixlConnector"),
    "dotted": (["vllm", "serve", "/m", "--kv-transfer-config.kv_connector", "NixlConnector",
                "--kv-transfer-config.kv_role", "kv_both"], None, "NixlConnector"),
    "dotted-equals-underscores": (["vllm", "serve", "/m", "--kv_transfer_config.kv_connector=NixlConnector",
                                   "--kv_transfer_config.kv_role=kv_both"], None, "NixlConnector"),
    "mixed-spelling": (["vllm", "serve", "/m", f"--kv_transfer-config={NIXL}"], None, "NixlConnector"),
    "abbreviated": (["vllm", "serve", "/m", "--kv-transfer", NIXL], None, "NixlConnector"),
    "bash-script": (["bash", "-c", SCRIPT.format(f"--kv-transfer-config '{NIXL}'"), "vllm"], None,
                    "NixlConnector"),
    "sh-script-dotted": (["sh", "-c", SCRIPT.format("--kv_transfer_config.kv_connector NixlConnector "
                                                    "--kv_transfer_config.kv_role kv_both"), "vllm"],
                         None, "NixlConnector"),
    "config": (["vllm", "serve", "/m", "--config", f"{CONFIG_DIR}/config.yaml"], NIXL_YAML, "NixlConnector"),
    "config-underscores-dotted": (["vllm", "serve", "/m", "--config", f"{CONFIG_DIR}/config.yaml"],
                                  "kv_transfer_config.kv_connector: NixlConnector\n"
                                  "kv_transfer_config.kv_role: kv_both\n", "NixlConnector"),
    "config-in-a-script": (["sh", "-c", SCRIPT.format(f"--config {CONFIG_DIR}/config.yaml"), "vllm"],
                           NIXL_YAML, "NixlConnector"),
    "config-without-connector": (["vllm", "serve", "/m", "--config", f"{CONFIG_DIR}/config.yaml"],
                                 "max-model-len: 128\n", "KVPoolConnector"),
}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_serve() -> Any:
    """`vllm serve`'s parser, built as vLLM's CLI builds it."""
    import argparse

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))

    def parse(argv: list[str]) -> argparse.Namespace:
        return parser.parse_args(argv)

    return parse


def vllm_argv(container: dict[str, Any], tmp: Path) -> list[str]:
    """The arguments the `vllm` program gets: through a real shell when the container runs a script."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[0] == "vllm":
        return argv[1:]
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "vllm"
    stand_in.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=30).stdout
    return json.loads(out)


@pytest.mark.parametrize("shape", SHAPES)
def test_vllm_runs_kvpools_connector_only_where_the_user_set_none(
    shape: str, vllm_serve: Any, tmp_path: Path
) -> None:
    command, config_text, runs = SHAPES[shape]
    config_dir = tmp_path / "config"  # the ConfigMap's volume, as the kubelet would write it
    config_dir.mkdir()
    container: dict[str, Any] = {"name": "vllm", "image": "vllm/vllm-openai", "command": command}
    spec: dict[str, Any] = {"containers": [container]}
    config_maps = {}
    if config_text is not None:
        (config_dir / "config.yaml").write_text(config_text)
        container["volumeMounts"] = [{"name": "config", "mountPath": CONFIG_DIR}]
        spec["volumes"] = [{"name": "config", "configMap": {"name": "vllm-config"}}]
        config_maps["vllm-config"] = {"data": {"config.yaml": config_text}}
    pod = {"metadata": {"labels": {"app": "vllm"}}, "spec": spec}
    pool = parse_pool("ns", "p", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"})

    decision = decide(pod, "ns", [pool], OperatorSettings(), None, config_maps)

    assert decision.pod is not None
    admitted = decision.pod["spec"]["containers"][0]
    argv = [a.replace(CONFIG_DIR, str(config_dir)) for a in vllm_argv(admitted, tmp_path)]
    assert vllm_serve(argv).kv_transfer_config.kv_connector == runs
    skipped = decision.pod["metadata"].get("annotations", {}).get("kvpool.dev/skipped")
    if runs == "KVPoolConnector":
        assert skipped is None
    else:
        assert skipped is not None and skipped.startswith("OwnConnector: "), skipped
        assert admitted == container  # untouched
