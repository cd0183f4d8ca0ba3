"""A pool's `Ready` and `Degraded` conditions from what refresh saw: Ready=True only while the pool
serves, so `kubectl wait --for=condition=Ready` means something.

Ready is True when the operator has handled the pool's current spec and nothing it created was
refused; every pod the pool matches carries the cache (none skipped, none the webhook never saw);
the sidecar of every injected Ready pod answers /stats; their Redis tier, if any, is up and lets them
in; kvpool is on in every vLLM engine that reported to them (it turns itself off for a model it
cannot cache: CacheOff); and no breaker is open. An engine whose chunks stay its own (weights it
cannot fingerprint) only degrades the pool: it still serves its own pod. With no matched pod yet, a
pool that is otherwise fine is Ready: it will serve the pods created from now on (a Deployment
applied after its pool must not wait on it). Pods still starting are not judged (a rolling update
does not flap the pool), but a pool whose pods are all starting is not Ready yet.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_operator.conditions import Condition
from kvpool_operator.pods import PodCounts
from kvpool_operator.vllm_breaker import RESET_ANNOTATION

# what a sidecar's tiers.redis.reason says when Redis refuses it rather than not answering
AUTH_REFUSED = re.compile(
    r"AuthenticationError|WRONGPASS|NOAUTH|Authentication required|invalid username-password|"
    r"invalid password|no KVPOOL_POOL_KEY|no pool key",
    re.IGNORECASE,
)
NAMED_PODS = 3  # pods named in a message


@dataclass(frozen=True)
class Seen:
    reconciled: bool  # the current generation handled (status.observedGeneration) and its config stored
    refused: str | None  # why the API server refused an object the operator creates (status.refused)
    counts: PodCounts
    sidecars: Sequence[Mapping[str, Any] | None]  # /stats of each injected Ready pod; None: no answer
    tier: tuple[int, int] | None = None  # the shared tier's (desired, ready) shards
    drain_gave_up: str | None = None  # why the tier's last shrink stopped shards undrained
    sidecar_breaker: Mapping[str, Any] | None = None  # status.sidecarNotStarting
    vllm_breaker: Mapping[str, Any] | None = None  # status.vllmFailing


def assess(seen: Seen) -> tuple[Condition, Condition]:
    """(Ready, Degraded): not Ready for the first problem, Degraded listing them all."""
    blocking, degrading = _problems(seen)
    found = blocking + degrading
    if blocking:
        reason, message = blocking[0]
        return Condition("Ready", False, reason, message), _degraded(found)
    counts = seen.counts
    message = (
        f"{counts.ready} pod(s) served by their sidecars"
        if counts.matched
        else "no pod matches the selector yet; pods created from now on get the cache"
    )
    return Condition("Ready", True, "Serving" if counts.matched else "NoPods", message), _degraded(found)


def _degraded(found: list[tuple[str, str]]) -> Condition:
    if not found:
        return Condition("Degraded", False, "Healthy", "")
    return Condition("Degraded", True, found[0][0], "; ".join(m for _, m in found))


def _problems(seen: Seen) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(what keeps the pool from serving, what only degrades it), most actionable first."""
    blocking: list[tuple[str, str]] = []
    degrading: list[tuple[str, str]] = []
    counts = seen.counts
    if not seen.reconciled:
        blocking.append(("Reconciling", "the operator has not yet handled the pool's current spec"))
    if seen.refused:
        blocking.append(("Refused", seen.refused))
    images = (seen.vllm_breaker or {}).get("images") or []
    if images:
        named = ", ".join(f"{b['image']} (pod {b['pod']}: {b['reason']})" for b in images)
        blocking.append((
            "VLLMFailing",
            f"vLLM fails in injected pods running {named}; pods running these images start without the "
            f"cache until their image changes or the pool is annotated {RESET_ANNOTATION}=<new value>",
        ))  # fmt: skip
    if seen.sidecar_breaker:
        b = seen.sidecar_breaker
        blocking.append((
            "SidecarNotStarting",
            f"the sidecar does not start in {b.get('pods')} pod(s) ({b.get('reason')}): new pods start "
            "without it until the pool changes",
        ))  # fmt: skip
    if counts.unseen:
        blocking.append((
            "InjectionNotEnabled",
            f"{len(counts.unseen)} matched pod(s) never reached kvpool's webhook ({_names(counts.unseen)}): "
            "label their namespace kvpool.dev/injection=enabled (or the webhook was down when they were "
            "created), then restart them",
        ))  # fmt: skip
    if counts.skipped:
        reasons = ", ".join(f"{r} {n}" for r, n in counts.skip_reasons.items())
        reason = next(iter(counts.skip_reasons)) if len(counts.skip_reasons) == 1 else "PodsSkipped"
        blocking.append((
            reason,
            f"{counts.skipped} of {counts.matched} matched pod(s) run without the cache ({reasons}); "
            f"e.g. {counts.skipped_example}",
        ))  # fmt: skip
    if seen.tier is not None:
        desired, ready = seen.tier
        if ready < 1:
            blocking.append(("SharedTierStarting", f"shared Redis tier starting: 0/{desired} shards ready"))
        elif ready < desired:
            degrading.append(("ShardsNotReady", f"shared Redis tier: {ready}/{desired} shards ready"))
    if seen.drain_gave_up:
        degrading.append((
            "DrainGaveUp",
            f"shared Redis tier: {seen.drain_gave_up} (their reads of those shards became misses)",
        ))  # fmt: skip
    if counts.matched and not counts.ready and not counts.skipped and not counts.unseen:
        blocking.append(("PodsNotReady", f"none of the {counts.matched} matched pod(s) is Ready yet"))
    silent = sum(1 for s in seen.sidecars if s is None)
    if silent:
        blocking.append((
            "SidecarsNotAnswering",
            f"{silent} of {len(seen.sidecars)} ready pod(s)' sidecars do not answer /stats (not running, "
            "or a NetworkPolicy keeps the operator from their status port)",
        ))  # fmt: skip
    answered = [s for s in seen.sidecars if s is not None]
    blocking += _redis_problems(answered)
    off, private = _engine_problems(answered)
    blocking += off
    degrading += private
    return blocking, degrading


def _engine_problems(stats: list[Mapping[str, Any]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """CacheOff / NotSharedAcrossPods from what each pod's vLLM engines told their sidecar at start."""
    pods = [list((s.get("engines") or {}).values()) for s in stats]
    off = _first_per_pod(pods, lambda e: e.get("cache") == "off")
    private = _first_per_pod(pods, lambda e: e.get("cache") == "on" and e.get("shared") is False)
    blocking: list[tuple[str, str]] = []
    degrading: list[tuple[str, str]] = []
    if off:
        blocking.append((
            "CacheOff",
            f"kvpool is off in the vLLM of {len(off)} of {len(stats)} pod(s), which serve without the cache: "
            f"{off[0].get('reason')} (model {off[0].get('model')})",
        ))  # fmt: skip
    if private:
        degrading.append((
            "NotSharedAcrossPods",
            f"the vLLM of {len(private)} of {len(stats)} pod(s) keep their chunks to themselves: "
            f"{private[0].get('reason')} (model {private[0].get('model')})",
        ))  # fmt: skip
    return blocking, degrading


def _redis_problems(stats: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """RedisAuthFailed / RedisUnreachable from the sidecars' tiers.redis, as each of them sees Redis."""
    down = [(s.get("tiers") or {}).get("redis") or {} for s in stats]
    down = [r for r in down if r and not r.get("ready")]
    refused = [r for r in down if AUTH_REFUSED.search(str(r.get("reason")))]
    unreachable = [r for r in down if r not in refused]
    found = []
    if refused:
        found.append((
            "RedisAuthFailed",
            f"Redis refuses {len(refused)} of {len(stats)} sidecar(s): {refused[0].get('reason')} (is the "
            "password Secret there, with the right key?)",
        ))  # fmt: skip
    if unreachable:
        found.append((
            "RedisUnreachable",
            f"{len(unreachable)} of {len(stats)} sidecar(s) cannot reach Redis: "
            f"{unreachable[0].get('reason')}",
        ))  # fmt: skip
    return found


def _first_per_pod(pods: list[list[Any]], found: Callable[[Any], bool]) -> list[Any]:
    """Each pod's first engine for which `found` holds; pods with none are left out."""
    return [next(e for e in engines if found(e)) for engines in pods if any(found(e) for e in engines)]


def _names(pods: list[str]) -> str:
    more = len(pods) - NAMED_PODS
    return ", ".join(pods[:NAMED_PODS]) + (f" and {more} more" if more > 0 else "")
