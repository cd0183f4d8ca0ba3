"""Whether a vLLM `--config FILE` sets a connector of the user's own.

vLLM reads its options from that YAML too (keys are the long option names, dashes or underscores), so a
connector set there is the user's as much as one on the command line. kvpool can read the file only
when it comes from a ConfigMap volume: the webhook reads those ConfigMaps (`config_maps_to_read`) and
hands them in. A file from anywhere else (the image, a Secret, an emptyDir) is unread: the pod is
skipped unless its annotation vouches that the file sets no connector.

Pure functions on plain dicts; the webhook does the reading.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvpool_operator import names
from kvpool_operator.vllm_target import Skip, config_paths, names_kv_transfer

UNREAD = "ConfigFileUnread"
INVALID = "ConfigFileInvalid"


@dataclass(frozen=True)
class Unreadable:
    """A ConfigMap the webhook could not read, and why (missing, forbidden, the API failing)."""

    why: str


ConfigMapRead = Mapping[str, Any] | Unreadable  # the ConfigMap as the API server returned it, or why not


@dataclass(frozen=True)
class ConfigMapKey:
    """Where a file comes from: this key of this ConfigMap."""

    name: str
    key: str


def config_maps_to_read(pod: Mapping[str, Any]) -> set[str]:
    """The ConfigMaps that any container's `--config` files come from."""
    wanted = set()
    for container in (pod.get("spec") or {}).get("containers") or []:
        for path in config_paths(container):
            found = source(pod, container, path)
            if isinstance(found, ConfigMapKey):
                wanted.add(found.name)
    return wanted


def config_connector(
    pod: Mapping[str, Any], index: int, config_maps: Mapping[str, ConfigMapRead]
) -> Skip | None:
    """Why container `index` cannot get kvpool's connector because of a `--config` file: the file sets
    the user's own (OwnConnector), cannot be read (ConfigFileUnread, unless the pod vouches for it) or
    is no YAML mapping (ConfigFileInvalid, which vLLM refuses too). None when every file is fine."""
    container = pod["spec"]["containers"][index]
    name = container.get("name", "?")
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    vouched = str(annotations.get(names.CONFIG_HAS_NO_CONNECTOR_ANNOTATION, "")).lower() == "true"
    for path in config_paths(container):
        text = _text(pod, container, path, config_maps)
        if not isinstance(text, str):
            if vouched:
                continue
            return Skip(
                UNREAD,
                f"container {name} reads vLLM options from --config {path}, which {text.why}, so kvpool "
                "cannot see whether it sets a connector: mount the file from a ConfigMap, or annotate the "
                f'pod {names.CONFIG_HAS_NO_CONNECTOR_ANNOTATION}: "true"',
            )
        try:
            options = yaml.safe_load(text)
        except yaml.YAMLError as e:
            return Skip(INVALID, f"container {name}'s --config {path} is not YAML: {_first_line(e)}")
        if not isinstance(options, dict):
            kind = type(options).__name__
            return Skip(INVALID, f"container {name}'s --config {path} is not a YAML mapping (a {kind})")
        keys = [k for k in options if _sets_connector(str(k))]
        if keys:
            return Skip(
                "OwnConnector",
                f"container {name} already sets {keys[0]} in its --config {path}; "
                "kvpool never replaces a user's connector",
            )
    return None


def _text(
    pod: Mapping[str, Any], container: Mapping[str, Any], path: str, config_maps: Mapping[str, ConfigMapRead]
) -> str | Unreadable:
    found = source(pod, container, path)
    if isinstance(found, Unreadable):
        return found
    read = config_maps.get(found.name, Unreadable("it was not read"))
    if isinstance(read, Unreadable):
        return Unreadable(f"comes from ConfigMap {found.name}, which kvpool cannot read ({read.why})")
    if found.key in (read.get("data") or {}):
        return str(read["data"][found.key])
    binary = (read.get("binaryData") or {}).get(found.key)
    if binary is not None:
        try:
            return base64.b64decode(binary).decode()
        except (binascii.Error, UnicodeDecodeError):
            return Unreadable(f"is key {found.key} of ConfigMap {found.name}, not UTF-8 text")
    return Unreadable(f"should be key {found.key} of ConfigMap {found.name}, which has no such key")


def source(pod: Mapping[str, Any], container: Mapping[str, Any], path: str) -> ConfigMapKey | Unreadable:
    """The ConfigMap key a file comes from, through the container's volume mounts (the deepest mount
    holding it, a subPath, an `items:` remapping), or why it does not come from one."""
    if not path or "$" in path or "`" in path:
        return Unreadable("the shell names at run time")
    if not path.startswith("/"):
        workdir = str(container.get("workingDir") or "")
        if not workdir.startswith("/"):
            return Unreadable("is relative to the image's working directory")
        path = posixpath.join(workdir, path)
    path = posixpath.normpath(path)
    mounts = [m for m in container.get("volumeMounts") or [] if _holds(str(m.get("mountPath", "")), path)]
    if not mounts:
        return Unreadable("is not on any volume (the image's own file)")
    mount = max(mounts, key=lambda m: len(posixpath.normpath(str(m["mountPath"]))))
    volume = next(
        (v for v in (pod.get("spec") or {}).get("volumes") or [] if v.get("name") == mount.get("name")), None
    )
    if volume is None or "configMap" not in volume:
        kind = next((k for k in (volume or {}) if k != "name"), "unknown")
        return Unreadable(f"comes from a {kind} volume, not a ConfigMap")
    if mount.get("subPathExpr"):
        return Unreadable("is mounted with a subPathExpr the kubelet expands")
    inside = posixpath.relpath(path, posixpath.normpath(str(mount["mountPath"])))
    inside = posixpath.normpath(posixpath.join(str(mount.get("subPath") or ""), inside))
    config_map = volume["configMap"]
    name = str(config_map.get("name", ""))
    items = config_map.get("items")
    if items:  # only the listed keys, each at its own path
        key = next(
            (i.get("key") for i in items if posixpath.normpath(str(i.get("path", ""))) == inside), None
        )
        if key is None:
            return Unreadable(f"is no item of ConfigMap {name}'s volume")
        return ConfigMapKey(name, str(key))
    if "/" in inside or inside in (".", ".."):
        return Unreadable(f"is not a key of ConfigMap {name}'s volume")
    return ConfigMapKey(name, inside)


def _holds(mount_path: str, path: str) -> bool:
    mount_path = posixpath.normpath(mount_path) if mount_path else ""
    return bool(mount_path) and (path == mount_path or path.startswith(mount_path.rstrip("/") + "/"))


def _sets_connector(key: str) -> bool:
    """A key vLLM turns into --kv-transfer-config (`--` + the key) or its dotted form."""
    return names_kv_transfer(f"--{key}")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
