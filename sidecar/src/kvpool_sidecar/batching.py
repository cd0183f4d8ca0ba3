"""How big batches are cut so that lookups keep being answered: one policy, four places.

The sidecar serves lookups on one event loop, and every pass over a batch holds the GIL. A batch is
therefore never handled in one long call: each limit below bounds how long one piece keeps the loop
(or the store's lock) from a lookup that arrives meanwhile.
"""

from __future__ import annotations

# A control request with more entries than this runs on a worker thread, not on the event loop
# (control.py; the Unix socket and HTTP alike).
OFF_LOOP_ENTRIES = 256

# Entries of one batch handled under one hold of the store's lock (store.py): a lookup waits at most
# one slice.
LOCKED_SLICE = 256

# A control-socket frame of more bytes than this is decoded, validated, run and answered off the
# event loop (control_socket.py).
OFF_LOOP_FRAME_BYTES = 64 * 1024

# Entries per reserve/commit/abort/verify frame the client sends; a bigger batch goes as several
# (client.py). The sidecar validates and encodes a frame in single calls (~5 us an entry): one
# 65,536-entry frame held lookups up to 1.4 s on a 2-core VM.
CLIENT_FRAME_ENTRIES = 4096
