"""A stand-in for vLLM in the pods scenarios: serves /health, and /report with what kvpool's
injection gave this container (its argv, the arena directory's files and whether this user can read
and write them), so a test reads what the vLLM container itself sees on a real kubelet."""

import http.server
import json
import os
import sys

ARENA_DIR = "/var/run/kvpool"


def report() -> dict:
    files = sorted(os.listdir(ARENA_DIR)) if os.path.isdir(ARENA_DIR) else []
    paths = [os.path.join(ARENA_DIR, f) for f in files]
    return {
        "argv": sys.argv[1:],
        "uid": os.getuid(),
        "groups": os.getgroups(),
        "arena_files": files,
        "arena_rw": {f: os.access(p, os.R_OK | os.W_OK) for f, p in zip(files, paths, strict=True)},
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
