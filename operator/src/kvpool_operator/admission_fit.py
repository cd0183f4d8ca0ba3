"""Whether a pod still fits its namespace's LimitRanges and ResourceQuotas with the sidecar in it.

The API server checks both after the webhook: a sidecar that pushes a pod over either gets the pod
refused (the ReplicaSet never gets a pod), and the webhook's failurePolicy cannot help, since the
webhook succeeded. So the webhook checks the injected pod as LimitRanger and the quota admission
would, and admits the pod untouched (with the reason) when the sidecar alone would break the fit. A
pod that breaks them anyway is not kvpool's to judge: only problems the sidecar adds count.

Pure functions on plain dicts, as the API server sends them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from kvpool_operator.quantity import quantity_value

Resources = dict[str, Decimal]  # resource name -> amount (cpu in cores, memory in bytes)


def _amounts(values: Mapping[str, Any] | None) -> Resources:
    return {name: quantity_value(v) for name, v in (values or {}).items()}


def _containers(pod: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], bool, bool]]:
    """(container, is an init container, is a sidecar: an init container that keeps running)."""
    spec = pod.get("spec") or {}
    out = [(c, False, False) for c in spec.get("containers") or []]
    for c in spec.get("initContainers") or []:
        out.append((c, True, c.get("restartPolicy") == "Always"))
    return out


def _defaulted(
    container: Mapping[str, Any], limit_ranges: Iterable[Mapping[str, Any]]
) -> tuple[Resources, Resources]:
    """(requests, limits) of a container after LimitRanger's defaults: a missing limit takes the
    range's `default`, a missing request its `defaultRequest`, else the limit (the API's default)."""
    resources = container.get("resources") or {}
    requests, limits = _amounts(resources.get("requests")), _amounts(resources.get("limits"))
    for item in _items(limit_ranges, "Container"):
        for name, v in _amounts(item.get("default")).items():
            limits.setdefault(name, v)
        for name, v in _amounts(item.get("defaultRequest")).items():
            requests.setdefault(name, v)
    for name, v in limits.items():
        requests.setdefault(name, v)
    return requests, limits


def _items(limit_ranges: Iterable[Mapping[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The limits of a type, with the API server's own defaulting of a Container item (what it stores):
    `default` is `max` where not given, `defaultRequest` is `default`, else `min`."""
    out = []
    for lr in limit_ranges:
        for item in (lr.get("spec") or {}).get("limits") or []:
            if item.get("type") != kind:
                continue
            item = {**item, "_range": (lr.get("metadata") or {}).get("name", "")}
            if kind == "Container":
                item["default"] = {**(item.get("max") or {}), **(item.get("default") or {})}
                given = {**(item.get("min") or {}), **item["default"]}
                item["defaultRequest"] = {**given, **(item.get("defaultRequest") or {})}
            out.append(item)
    return out


def _pod_total(parts: list[tuple[Resources, bool, bool]]) -> Resources:
    """The pod's effective amount, as the API server counts it with sidecars: the regular containers
    and the sidecars together, or an init container beside the sidecars started before it,
    whichever is larger, resource by resource."""
    steady: Resources = {}
    sidecars: Resources = {}
    peak: Resources = {}
    for amounts, init, sidecar in parts:
        if init and not sidecar:
            for name in set(amounts) | set(sidecars):
                peak[name] = max(
                    peak.get(name, Decimal(0)), amounts.get(name, Decimal(0)) + sidecars.get(name, Decimal(0))
                )
            continue
        for name, v in amounts.items():
            steady[name] = steady.get(name, Decimal(0)) + v
            if sidecar:
                sidecars[name] = sidecars.get(name, Decimal(0)) + v
    return {
        name: max(steady.get(name, Decimal(0)), peak.get(name, Decimal(0)))
        for name in set(steady) | set(peak)
    }


def _show(name: str, value: Decimal | None) -> str:
    """A quantity as a person reads it: memory in Mi, CPU in cores."""
    if value is None:
        return "not set"
    if name.endswith(("memory", "storage")) and value >= 2**20:
        return f"{value / 2**20:.0f}Mi"
    return f"{value.normalize():f}"


def _check(
    where: str, rng: str, requests: Resources, limits: Resources, item: Mapping[str, Any]
) -> list[str]:
    """LimitRanger's min, max and maxLimitRequestRatio for one container or a pod."""
    out = []
    for name, bound in _amounts(item.get("min")).items():
        if name not in requests or requests[name] < bound:
            got, least = _show(name, requests.get(name)), _show(name, bound)
            out.append(f"LimitRange {rng}: minimum {name} per {where} is {least}, the request is {got}")
    for name, bound in _amounts(item.get("max")).items():
        if name not in limits or limits[name] > bound:
            got, most = _show(name, limits.get(name)), _show(name, bound)
            out.append(f"LimitRange {rng}: maximum {name} per {where} is {most}, the limit is {got}")
    for name, ratio in _amounts(item.get("maxLimitRequestRatio")).items():
        if name in limits and requests.get(name) and limits[name] / requests[name] > ratio:
            out.append(f"LimitRange {rng}: {name} limit/request per {where} is at most {ratio}")
    return out


def limit_range_problems(pod: Mapping[str, Any], limit_ranges: Iterable[Mapping[str, Any]]) -> list[str]:
    """What LimitRanger would refuse the pod for (its Container and Pod limits)."""
    ranges = list(limit_ranges)
    problems: list[str] = []
    requests, limits = [], []
    for container, init, sidecar in _containers(pod):
        req, lim = _defaulted(container, ranges)
        requests.append((req, init, sidecar))
        limits.append((lim, init, sidecar))
        for item in _items(ranges, "Container"):
            problems += _check(f"Container ({container.get('name')})", item["_range"], req, lim, item)
    for item in _items(ranges, "Pod"):
        problems += _check("Pod", item["_range"], _pod_total(requests), _pod_total(limits), item)
    return problems


def _quota_usage(pod: Mapping[str, Any], limit_ranges: Iterable[Mapping[str, Any]]) -> Resources:
    """What a pod charges a quota: requests.* (also under the bare name) and limits.*."""
    ranges = list(limit_ranges)
    parts = [(_defaulted(c, ranges), init, sidecar) for c, init, sidecar in _containers(pod)]
    requests = _pod_total([(r, i, s) for (r, _), i, s in parts])
    limits = _pod_total([(lim, i, s) for (_, lim), i, s in parts])
    usage = {f"requests.{n}": v for n, v in requests.items()} | {n: v for n, v in requests.items()}
    return usage | {f"limits.{n}": v for n, v in limits.items()}


def quota_problems(
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    quotas: Iterable[Mapping[str, Any]],
    limit_ranges: Iterable[Mapping[str, Any]] = (),
) -> list[str]:
    """The quotas the injected pod would exceed where the pod as sent would not. Every quota is taken
    to apply (its scopes are not read): a pod wrongly left without the cache still runs, a pod
    wrongly refused does not."""
    ranges = list(limit_ranges)
    charged_before, charged_after = _quota_usage(before, ranges), _quota_usage(after, ranges)
    out = []
    for quota in quotas:
        name = (quota.get("metadata") or {}).get("name", "")
        hard = _amounts((quota.get("status") or {}).get("hard") or (quota.get("spec") or {}).get("hard"))
        used = _amounts((quota.get("status") or {}).get("used"))
        for resource, bound in hard.items():
            base = used.get(resource, Decimal(0))
            if (
                base + charged_after.get(resource, Decimal(0))
                > bound
                >= base + charged_before.get(resource, Decimal(0))
            ):
                now = _show(resource, base + charged_before.get(resource, Decimal(0)))
                then = _show(resource, base + charged_after[resource])
                out.append(
                    f"ResourceQuota {name}: {resource} would be {then} of {_show(resource, bound)} "
                    f"with the sidecar ({now} without)"
                )
    return out


def added_by_injection(
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    limit_ranges: Iterable[Mapping[str, Any]],
    quotas: Iterable[Mapping[str, Any]],
) -> tuple[str, str] | None:
    """(reason, message) when the sidecar alone would get the pod refused (or the limits cannot be
    read, so that cannot be ruled out), else None."""
    ranges, quotas = list(limit_ranges), list(quotas)
    try:
        # a limit the pod breaks anyway is not the sidecar's (its numbers change with it: compare
        # what each problem is about, the words before " is ")
        already = {p.split(" is ")[0] for p in limit_range_problems(before, ranges)}
        added = [p for p in limit_range_problems(after, ranges) if p.split(" is ")[0] not in already]
        over = quota_problems(before, after, quotas, ranges)
    except (ValueError, ArithmeticError, TypeError, AttributeError) as e:  # a quantity we cannot read
        return "LimitsUnreadable", f"cannot read the namespace's LimitRanges or ResourceQuotas: {e}"
    refused = "with the sidecar the API server would refuse the pod: "
    if added:
        return "LimitRangeExceeded", refused + "; ".join(added)
    if over:
        return "QuotaExceeded", refused + "; ".join(over)
    return None
