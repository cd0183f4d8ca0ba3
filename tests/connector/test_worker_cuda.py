"""The worker's CUDA path, against the real sidecar: the arena registered once (cudaHostRegister),
saves copied out layer by layer on a side stream into private pinned buffers and hashed there after
the copies, loads hashed in a private pinned buffer before the DMA to the device.

What a GPU run must show: these pass, bit-exact, with the layers on the GPU. make test deselects
them (marker gpu; no GPU in CI); where one is lent: `pytest -m gpu tests/connector/test_worker_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
from workerkit import Layers, chunk_ops, make_layers, run_loads, save

from kvpool_connector.common import ChunkOp, KVPoolMetadata, LoadSpec, SaveSpec
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import rank_key
from kvpool_connector.worker import KVPoolWorker
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.gpu  # deselected by make test


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run where a GPU is lent)")


def _layers(seed: int | None) -> Layers:
    return make_layers(seed, torch.float16, "cuda")


def test_cuda_save_then_load_is_exact_and_the_arena_is_registered_once(sidecar_factory) -> None:
    proc = sidecar_factory("64Mi")
    cfg = KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64)
    src, dst = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=0)
    src_layers, dst_layers = _layers(1), _layers(None)
    src.register_kv_caches(src_layers)
    dst.register_kv_caches(dst_layers)
    saves = chunk_ops([[3, 7], [1, 12], [5, 6]])
    meta = KVPoolMetadata(saves=[SaveSpec("a", 0, saves)])
    for name, _ in src_layers:  # as vLLM calls it inside the forward, layer by layer
        src.save_layer(name, meta)
    save(src, meta)
    assert src.take_stats().data["saved_chunks"] == 3
    loads = [ChunkOp(op.link, 2, ids) for op, ids in zip(saves, [[0, 2], [4, 8], [9, 10]], strict=True)]
    assert run_loads(dst, KVPoolMetadata(loads=[LoadSpec("b", loads)])) == set()
    torch.cuda.synchronize()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        for sb, db in [(3, 0), (7, 2), (1, 4), (12, 8), (5, 9), (6, 10)]:
            assert torch.equal(s[sb], d[db])
    for w in (src, dst):
        assert [m.registered for m in w._mapping._all] == [True]  # mapped and registered once
    src.shutdown()
    dst.shutdown()


def test_cuda_corrupt_chunk_never_reaches_the_device(sidecar_factory) -> None:
    proc = sidecar_factory("64Mi")
    cfg = KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64)
    src, dst = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=0)
    src.register_kv_caches(_layers(3))
    dst_layers = _layers(None)
    dst.register_kv_caches(dst_layers)
    saves = chunk_ops([[0, 1], [2, 3]])
    save(src, KVPoolMetadata(saves=[SaveSpec("a", 0, saves)]))
    client = SidecarClient(proc.info["url"], timeout=5)
    pinned = client.pin([rank_key(saves[1].link, 0)])
    client.arena()[pinned.slots[0].offset + 100] ^= 0x01
    client.release(pinned.lease)
    failed = run_loads(dst, KVPoolMetadata(loads=[LoadSpec("b", chunk_ops([[6, 7], [8, 9]]))]))
    assert failed == {8, 9}
    torch.cuda.synchronize()
    for _, d in dst_layers:  # hashed in the private buffer before any DMA: nothing was copied
        assert not d[8].any() and not d[9].any()
    src.shutdown()
    dst.shutdown()
