"""The CRD's schema as the API server applies it, for tests: defaulting, a JSON Schema for the
structural OpenAPI schema (with strict field validation, as `kubectl apply` does by default), and
the x-kubernetes-validations CEL rules evaluated with cel-python."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema


def version_schema(crd: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Fills `default`s into objects that are present, recursively (the API server's defaulting)."""
    obj = copy.deepcopy(obj)
    _default(schema, obj)
    return obj


def _default(schema: dict[str, Any], node: Any) -> None:
    if isinstance(node, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in node and "default" in sub:
                node[key] = copy.deepcopy(sub["default"])
            if key in node:
                _default(sub, node[key])
    elif isinstance(node, list) and "items" in schema:
        for item in node:
            _default(schema["items"], item)


def to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Structural schema -> JSON Schema: unknown fields refused unless preserved, x- keys dropped."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("default", "description", "format"):
            continue
        if key == "properties":
            out[key] = {k: to_json_schema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key == "anyOf":
            out[key] = [to_json_schema(v) for v in value]
        else:
            out[key] = value
    if (
        schema.get("type") == "object"
        and "properties" in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out.setdefault("additionalProperties", False)
    return out


def schema_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    """Errors named by field path, the way the API server names them (a missing field by its own path)."""
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    errors = []
    for e in validator.iter_errors(obj):
        path = e.json_path.replace("$.", "", 1)
        if e.validator == "required":
            path = f"{path}.{e.message.split(chr(39))[1]}"
        errors.append(f"{path}: {e.message}")
    return errors


def rules(schema: dict[str, Any], node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(path, rule, the value `self` is bound to) for every CEL rule that applies to `node`."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule, node
    if isinstance(node, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in node:
                yield from rules(sub, node[key], f"{path}.{key}" if path else key)
    elif isinstance(node, list) and "items" in schema:
        for i, item in enumerate(node):
            yield from rules(schema["items"], item, f"{path}[{i}]")


_env = celpy.Environment()


def cel_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    """Messages of the CEL rules that evaluate to false (as the API server would report them)."""
    failed = []
    for path, rule, value in rules(schema, obj):
        program = _env.program(_env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            failed.append(f"{path}{rule.get('fieldPath', '')}: {rule['message']}")
    return failed


def validate(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Everything the API server would say about `obj`, after defaulting: schema errors, then CEL rules."""
    schema = version_schema(crd)
    defaulted = apply_defaults(schema, obj)
    errors = schema_errors(schema, defaulted)
    return errors or cel_errors(schema, defaulted)  # CEL rules only run on schema-valid objects
