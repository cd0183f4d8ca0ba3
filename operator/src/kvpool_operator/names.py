"""Names, labels and paths the operator, the webhook and the sidecar agree on."""

from __future__ import annotations

GROUP = "kvpool.dev"
VERSION = "v1alpha1"
PLURAL = "kvcachepools"
KIND = "KVCachePool"
API_VERSION = f"{GROUP}/{VERSION}"

# pods
INJECT_ANNOTATION = "kvpool.dev/inject"  # "false" opts a pod out
POOL_LABEL = "kvpool.dev/pool"  # on injected pods: the pool's name
CONFIG_HASH_ANNOTATION = "kvpool.dev/config-hash"  # on injected pods: a digest of all kvpool added
STATUS_PORT_ANNOTATION = "kvpool.dev/status-port"  # on injected pods: where the operator reads /stats
SKIPPED_ANNOTATION = "kvpool.dev/skipped"  # on pods a pool selects but kvpool cannot configure: "Reason: why"
# "true" on a pod whose vLLM --config file kvpool cannot read (not from a ConfigMap): the user vouches
# that it sets no --kv-transfer-config, so kvpool's flag may be added
CONFIG_HAS_NO_CONNECTOR_ANNOTATION = "kvpool.dev/config-has-no-connector"
SIDECAR_CONTAINER = "kvpool-sidecar"
ARENA_VOLUME = "kvpool-arena"
ARENA_DIR = "/var/run/kvpool"
# The group the arena and control socket belong to: the sidecar runs with it, and the pod's
# supplementalGroups give it to the vLLM container too, so the files need not be world-writable.
ARENA_GROUP = 65532
# The connector reaches a stock vLLM image by itself: an init container from the sidecar's image copies
# a self-contained payload (the connector, the sidecar's client, xxhash for every CPython 3.10+) into a
# volume that the vLLM container mounts and finds first on its PYTHONPATH.
CONNECTOR_CONTAINER = "kvpool-connector"
CONNECTOR_VOLUME = "kvpool-connector"
CONNECTOR_DIR = "/opt/kvpool-connector"  # the payload in the sidecar image, and its mount in vLLM's container
CONNECTOR_STAGING_DIR = "/mnt/kvpool-connector"  # the volume, in the init container that fills it
CONNECTOR_ANNOTATION = "kvpool.dev/connector"  # "image": the vLLM image has the connector; stage none
REDIS_URLS_VOLUME = "kvpool-redis-urls"
REDIS_URLS_DIR = "/etc/kvpool/redis"
# the pool key and the Redis password, as files of a projected volume of the Secrets: the kubelet
# rewrites them when a Secret is made again, and the sidecar reads them again (env would stay old)
CREDENTIALS_VOLUME = "kvpool-credentials"
CREDENTIALS_DIR = "/etc/kvpool/credentials"
POOL_KEY_FILE = "pool-key"
REDIS_PASSWORD_FILE = "redis-password"
KV_TRANSFER_FLAG = "--kv-transfer-config"

# owned objects
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "kvpool-operator"
COMPONENT_LABEL = "app.kubernetes.io/component"
CONFIG_KEY = "kv-transfer-config.json"  # ConfigMap key: the connector config
REDIS_URLS_KEY = "redis-urls"  # ConfigMap key: one shard URL a line (the sidecar's --redis-urls-file)
PASSWORD_KEY = "password"
POOL_KEY_KEY = "pool-key"  # the Secret key of the pool's chunk-authentication secret
LAST_SCALE_ANNOTATION = "kvpool.dev/last-scale-time"  # on the shared tier's StatefulSet
DRAIN_SINCE_ANNOTATION = "kvpool.dev/drain-since"  # when its shrink began waiting on the sidecars
DRAIN_GAVE_UP_ANNOTATION = "kvpool.dev/drain-gave-up"  # why its last shrink stopped shards undrained
# on the shards' pod template: the checksum of a password made again, so that they restart with it
CREDENTIALS_CHECKSUM_ANNOTATION = "kvpool.dev/credentials-checksum"
REDIS_PORT = 6379
# The shard user the operator reads INFO memory as: no password, no access to data, so the operator
# never reads the shards' password Secret (it may create Secrets, never read them).
MONITOR_USER = "kvpool-monitor"


def config_map_name(pool: str) -> str:
    return f"{pool}-kvpool"


def redis_name(pool: str) -> str:
    """The shared tier's StatefulSet, headless Service and password Secret."""
    return f"{pool}-kvpool-redis"


def pool_key_secret(pool: str) -> str:
    """The Secret with the key that authenticates the pool's chunks in Redis (any Redis mode)."""
    return f"{pool}-kvpool-key"


def owned_labels(pool: str, component: str) -> dict[str, str]:
    return {MANAGED_BY_LABEL: MANAGED_BY, POOL_LABEL: pool, COMPONENT_LABEL: component}
