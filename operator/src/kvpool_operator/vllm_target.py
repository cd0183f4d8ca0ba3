"""Which container of a pod is vLLM, and whether kvpool can configure it without breaking it.

kvpool adds its connector as one more argument of the vLLM command line, so it must know which
container that is (never blindly the first: another injector's proxy may be first), that the argument
reaches vLLM (not a shell's `$0`), and that it replaces no connector of the user's own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_operator.names import KV_TRANSFER_FLAG

SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"})
FLAG_SPELLINGS = (KV_TRANSFER_FLAG, "--kv_transfer_config")  # vLLM's parser takes either
OUR_CONNECTOR = ("KVPoolConnector", "kvpool_connector")  # (kv_connector, kv_connector_module_path)
_RUNS_VLLM = re.compile(r"(^|[\s/'\"])vllm($|[\s'\"])|vllm\.entrypoints")


@dataclass(frozen=True)
class Skip:
    """Why a pod is admitted without its cache: `reason` is counted in the pool's status."""

    reason: str
    message: str


def target_container(pod: Mapping[str, Any], named: str | None) -> int | Skip:
    """The index of the vLLM container kvpool can configure, or why there is none."""
    containers = (pod.get("spec") or {}).get("containers") or []
    if named is not None:
        found = [i for i, c in enumerate(containers) if c.get("name") == named]
        if not found:
            return Skip("ContainerNotFound", f"the pool names container {named!r}; the pod has none")
    else:
        found = [i for i, c in enumerate(containers) if runs_vllm(c)]
        if not found:
            return Skip(
                "NoVLLMContainer",
                "no container runs vllm (by its command or image); name it in the pool's spec.vllmContainer",
            )
        if len(found) > 1:
            which = ", ".join(containers[i].get("name", "?") for i in found)
            return Skip(
                "SeveralVLLMContainers",
                f"containers {which} all look like vllm; name one in the pool's spec.vllmContainer",
            )
    container = containers[found[0]]
    name = container.get("name", "?")
    if not shell_passes_arguments(container):
        return Skip(
            "StartedThroughShell",
            f"container {name} starts vllm through a shell script that does not pass on its arguments, so "
            'an added flag never reaches vllm: run vllm as the command, or end the script with "$@" and '
            "give the shell its $0 (sh -c '... exec vllm serve ... \"$@\"' vllm)",
        )
    user = users_connector(container)
    if user is not None:
        return Skip(
            "OwnConnector",
            f"container {name} already sets {KV_TRANSFER_FLAG} ({user}); "
            "kvpool never replaces a user's connector",
        )
    return found[0]


def runs_vllm(container: Mapping[str, Any]) -> bool:
    """By its command line, or when it has none (the image's entrypoint runs), by its image's name."""
    command = [str(a) for a in container.get("command") or []]
    if command:
        return any(_RUNS_VLLM.search(a) for a in [*command, *(str(a) for a in container.get("args") or [])])
    image = str(container.get("image") or "").rsplit("/", 1)[-1].split("@")[0].split(":")[0]
    return "vllm" in image


def shell_passes_arguments(container: Mapping[str, Any]) -> bool:
    """True unless the container runs `sh -c SCRIPT` where an appended flag would not reach vLLM: the
    script must use "$@", and something must fill $0 before the flag (else the flag becomes $0)."""
    argv = [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    if not argv or argv[0].rsplit("/", 1)[-1] not in SHELLS:
        return True
    options = next((i for i, a in enumerate(argv[1:], 1) if not a.startswith("-") or "c" in a[1:]), None)
    if options is None or not argv[options].startswith("-"):
        return False  # a script file: what it does with its arguments cannot be seen
    script = argv[options + 1] if options + 1 < len(argv) else ""
    return "$@" in script and len(argv) > options + 2


def users_connector(container: Mapping[str, Any]) -> str | None:
    """The connector a `--kv-transfer-config` already in the container names, unless it is kvpool's
    own (a pod injected before: re-injection replaces it)."""
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    for value in flag_values(argv):
        named = _named_connector(value)
        if named != OUR_CONNECTOR:
            return f"kv_connector {named[0]!r}" if named else "a value that is not a JSON object"
    return None


def flag_values(argv: Sequence[Any]) -> list[str]:
    values = []
    for i, arg in enumerate(str(a) for a in argv):
        for flag in FLAG_SPELLINGS:
            if arg == flag:
                values.append(str(argv[i + 1]) if i + 1 < len(argv) else "")
            elif arg.startswith(flag + "="):
                values.append(arg[len(flag) + 1 :])
    return values


def strip_ours(argv: list[Any]) -> list[Any]:
    """argv without kvpool's own `--kv-transfer-config value` (or `=value`); a user's stays."""
    out: list[Any] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        text = str(arg)
        if text in FLAG_SPELLINGS and i + 1 < len(argv) and _ours(str(argv[i + 1])):
            skip = True
        elif not any(text.startswith(f + "=") and _ours(text[len(f) + 1 :]) for f in FLAG_SPELLINGS):
            out.append(arg)
    return out


def _ours(value: str) -> bool:
    return _named_connector(value) == OUR_CONNECTOR


def _named_connector(value: str) -> tuple[Any, Any] | None:
    """(kv_connector, kv_connector_module_path) of a --kv-transfer-config value; None if no JSON object."""
    try:
        config = json.loads(value)
    except ValueError:
        return None
    if not isinstance(config, dict):
        return None
    return config.get("kv_connector"), config.get("kv_connector_module_path")
