"""A stand-in for vLLM in the pods scenarios: serves /health, and /report with what kvpool's
injection gave this container (its argv, the arena directory's files and whether this user can read
and write them, the connector it loaded), so a test reads what the vLLM container itself sees on a
real kubelet.

It runs on the image's bare Debian python3, which has neither kvpool nor xxhash: like a stock vLLM
image. At start it loads the connector's module as vLLM's KVConnectorFactory does, and exits when it
cannot, as vLLM does (the pod crash-loops); /report then puts and gets a chunk through the loaded
client. The connector's class itself needs torch, which this image does not have."""

import http.server
import importlib
import json
import os
import sys

ARENA_DIR = "/var/run/kvpool"


def kv_transfer_config() -> dict:
    argv = sys.argv[1:]
    flag = "--kv-transfer-config"
    return json.loads(argv[argv.index(flag) + 1]) if flag in argv else {}


CONFIG = kv_transfer_config()
if CONFIG and os.environ.get("STANDIN_EXIT_ON_KVPOOL") == "1":
    sys.exit(3)  # a vLLM that cannot run with kvpool's connector, whatever the reason
CONNECTOR = importlib.import_module(CONFIG["kv_connector_module_path"]) if CONFIG else None


def through_the_connector() -> dict:
    """A chunk put and read back by the loaded connector's own sidecar client."""
    if CONNECTOR is None:
        return {}
    import xxhash

    from kvpool_connector.config import load_config
    from kvpool_sidecar.client import SidecarClient

    config, _ = load_config(CONFIG.get("kv_connector_extra_config"))
    key, data = os.urandom(16).hex(), os.urandom(4096)
    found = {"module": CONNECTOR.__file__, "xxhash": xxhash.__file__}
    try:  # a sidecar that is (re)starting does not answer yet: the test waits on this
        with SidecarClient(config.sidecar_url) as client:
            return {**found, "stored": client.put(key, data), "read_back": client.get(key) == data}
    except Exception as e:
        return {**found, "error": repr(e)}


def report() -> dict:
    files = sorted(os.listdir(ARENA_DIR)) if os.path.isdir(ARENA_DIR) else []
    paths = [os.path.join(ARENA_DIR, f) for f in files]
    return {
        "argv": sys.argv[1:],
        "python": sys.executable,
        "uid": os.getuid(),
        "groups": os.getgroups(),
        "arena_files": files,
        "arena_rw": {f: os.access(p, os.R_OK | os.W_OK) for f, p in zip(files, paths, strict=True)},
        "connector": through_the_connector(),
    }


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps(report()).encode() if self.path == "/report" else b"ok"
        self.send_response(200 if self.path in ("/health", "/report") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
