"""Which container of a pod is vLLM, and whether kvpool can configure it without breaking it.

kvpool adds its connector as one more argument of the vLLM command line, so it must know which
container that is (never blindly the first: another injector's proxy may be first), that the argument
reaches vLLM (not a shell's `$0`), and that it replaces no connector of the user's own.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_operator.names import KV_TRANSFER_FLAG

SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"})
FLAG_SPELLINGS = (KV_TRANSFER_FLAG, "--kv_transfer_config")  # vLLM's parser takes either
OUR_CONNECTOR = ("KVPoolConnector", "kvpool_connector")  # (kv_connector, kv_connector_module_path)
_RUNS_VLLM = re.compile(r"(^|[\s/'\"])vllm($|[\s'\"])|vllm\.entrypoints")
_KV_TRANSFER = re.compile(r"kv[-_]transfer[-_]config", re.IGNORECASE)  # in a script, any spelling
# the shortest prefix of the option's name argparse's abbreviations take for it (--kv-transfer works)
_SHORTEST_ABBREVIATION = "kv-t"


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
    argv = _argv(container)
    if not argv or argv[0].rsplit("/", 1)[-1] not in SHELLS:
        return True
    options = _shell_options(argv)
    if options is None or not argv[options].startswith("-"):
        return False  # a script file: what it does with its arguments cannot be seen
    script = argv[options + 1] if options + 1 < len(argv) else ""
    return "$@" in script and len(argv) > options + 2


def shell_script(container: Mapping[str, Any]) -> str | None:
    """The text of a `sh -c SCRIPT` the container runs; None when it runs no shell script inline."""
    argv = _argv(container)
    if not argv or argv[0].rsplit("/", 1)[-1] not in SHELLS:
        return None
    options = _shell_options(argv)
    if options is None or not argv[options].startswith("-") or options + 1 >= len(argv):
        return None
    return argv[options + 1]


def _shell_options(argv: list[str]) -> int | None:
    """The index of the shell's option word holding -c, else of its first operand (a script file)."""
    return next((i for i, a in enumerate(argv[1:], 1) if not a.startswith("-") or "c" in a[1:]), None)


def _argv(container: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]


def users_connector(container: Mapping[str, Any]) -> str | None:
    """How the container already sets a connector of its own, or None. kvpool's own (a pod injected
    before: re-injection replaces it) is no user's. Seen in every shape vLLM reads from argv: the flag
    with a value (`=value` or the next word; dashes or underscores, or an abbreviation argparse takes),
    the dotted form (`--kv-transfer-config.kv_connector X`: vLLM merges these into one value appended
    after the others, so it would win over kvpool's), and a shell script's text that mentions it."""
    script = shell_script(container)
    if script is not None and _KV_TRANSFER.search(script):
        return "in its shell script"
    argv = _argv(container)
    for i, arg in enumerate(argv):
        option = _kv_transfer_option(arg)
        if option is None:
            continue
        name, dotted, value = option
        if dotted:
            return f"as {name} (vLLM's dotted form)"
        if value is None:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        named = _named_connector(value)
        if named != OUR_CONNECTOR:
            return f"kv_connector {named[0]!r}" if named else "a value that is not a JSON object"
    return None


def _kv_transfer_option(arg: str) -> tuple[str, bool, str | None] | None:
    """(the option as written, whether it is dotted, its `=value` if any) when `arg` is an option vLLM
    reads as --kv-transfer-config."""
    name, eq, value = arg.partition("=")
    if not names_kv_transfer(name):
        return None
    return name, "." in name, value if eq else None


def names_kv_transfer(option: str) -> bool:
    """Whether vLLM reads `option` (`--name` or `--name.field`, no value) as --kv-transfer-config: it
    turns underscores into dashes before the first dot, and argparse takes any unambiguous prefix of a
    long option."""
    if not option.startswith("--"):
        return False
    normal = option[2:].partition(".")[0].replace("_", "-").lower()
    return len(normal) >= len(_SHORTEST_ABBREVIATION) and KV_TRANSFER_FLAG[2:].startswith(normal)


def config_paths(container: Mapping[str, Any]) -> list[str]:
    """The files vLLM reads options from (`--config FILE` or `--config=FILE`), in argv or in the words
    of its shell script (a script that cannot be split is read word by word)."""
    paths = _config_arguments(_argv(container))
    script = shell_script(container)
    if script is not None:
        try:
            words = shlex.split(script)
        except ValueError:
            words = script.split()
        paths += _config_arguments(words)
    return paths


def _config_arguments(argv: Sequence[str]) -> list[str]:
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config":
            paths.append(argv[i + 1] if i + 1 < len(argv) else "")
        elif arg.startswith("--config="):
            paths.append(arg.removeprefix("--config="))
    return paths


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
