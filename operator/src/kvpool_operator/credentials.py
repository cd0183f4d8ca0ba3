"""The pool's generated Secrets: its chunk key (any Redis tier) and its shards' password (shared tier).

Each is made once with a random value and never written again: the operator may create Secrets, never
read them. One that was deleted is made again (at the next reconcile or refresh round) with a new
value, and then, so that the pool never splits in two:
- the shards roll: the new value's checksum goes into their pod template, so they restart with it;
- the sidecars read both from a projected volume of the Secrets, which the kubelet rewrites, and take
  the new values without a restart (until then an old password or key is only ever a miss);
- a Warning event says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kvpool_operator import events, names, objects
from kvpool_operator.kube import ApiError, Kube
from kvpool_operator.pool import Pool


def checksum(secret: Mapping[str, Any]) -> str:
    """A short digest of a generated Secret's value: what rolls the shards, never the value itself."""
    data = "".join(secret["data"][key] for key in sorted(secret["data"]))
    return hashlib.sha256(data.encode()).hexdigest()[:16]


async def ensure(kube: Kube, pool: Pool, owner: Mapping[str, Any]) -> None:
    """Makes the pool's generated Secrets that are missing; one made again rolls what uses it."""
    wanted = []
    if pool.redis is not None:
        wanted.append(objects.pool_key_secret(pool, owner))
    if pool.shared_tier:
        wanted.append(objects.password_secret(pool, owner))
    made = [secret for secret in wanted if await kube.create_once("Secret", pool.namespace, secret)]
    if not made or await kube.get("ConfigMap", pool.namespace, names.config_map_name(pool.name)) is None:
        return  # nothing made, or the pool's first reconcile (its ConfigMap comes after its Secrets)
    password = names.redis_name(pool.name)
    for secret in made:
        if secret["metadata"]["name"] == password:
            await _roll_shards(kube, pool, checksum(secret))
    made_names = ", ".join(s["metadata"]["name"] for s in made)
    await events.post(
        kube,
        pool,
        "Warning",
        "CredentialsRecreated",
        f"Secret {made_names} was missing and is made again with a new value: the shards restart with it "
        "and the sidecars read it from their mounted Secret (the kubelet updates it within a minute or "
        "two); until then the shared tier is a miss for the pods that have the old value",
    )


async def _roll_shards(kube: Kube, pool: Pool, digest: str) -> None:
    template = {"metadata": {"annotations": {names.CREDENTIALS_CHECKSUM_ANNOTATION: digest}}}
    try:
        await kube.patch(
            "StatefulSet", pool.namespace, names.redis_name(pool.name), {"spec": {"template": template}}
        )
    except ApiError as e:
        if e.status != 404:  # no StatefulSet yet: it starts with the new Secret
            raise
