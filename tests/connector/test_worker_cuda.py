"""The worker's CUDA path, against the real sidecar: saves copied out layer by layer on a side stream
(behind the forward's writes) into private pinned buffers and hashed there after the copies, loads
hashed in a private pinned buffer before the DMA to the device; every layout vLLM uses, bit-exact.

What a GPU run must show: these pass, bit-exact, with the layers on the GPU. make test deselects
them (marker gpu; no GPU in CI). They import no vLLM, so they run on a GPU machine with torch alone:
`pytest -m gpu tests/connector/test_worker_cuda.py`, or `scripts/gpu-check.sh` (which also removes each
stream ordering in turn from a copy of the code to show its test failing, and runs `bench cuda`).
"""

from __future__ import annotations

import signal

import pytest
import torch
from kvtest import Proc
from test_paged import LAYOUTS, _cache
from workerkit import Layers, chunk_ops, make_layers, run_loads, save

from kvpool_connector.common import ChunkOp, LoadSpec, SaveSpec, StepPlan
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


def _workers(
    proc: Proc, src_layers: Layers, dst_layers: Layers, groups: list[list[int]] | None = None
) -> tuple[KVPoolWorker, KVPoolWorker]:
    """Two workers on one sidecar: `src` over src_layers, `dst` over dst_layers."""
    cfg = KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64)
    src, dst = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=0)
    src.register_kv_caches(src_layers, groups=groups)
    dst.register_kv_caches(dst_layers, groups=groups)
    return src, dst


def test_cuda_save_then_load_is_exact_on_an_arena_cuda_cannot_register(sidecar_factory) -> None:
    """The arena here is a file on a disk filesystem (the test's tmp_path), which cudaHostRegister
    refuses; no copy needs it registered. (Registering it used to leave CUDA's error set: every load
    then failed with "invalid argument" at its first copy.)"""
    proc = sidecar_factory("64Mi")
    src_layers, dst_layers = _layers(1), _layers(None)
    src, dst = _workers(proc, src_layers, dst_layers)
    saves = chunk_ops([[3, 7], [1, 12], [5, 6]])
    meta = StepPlan(saves=[SaveSpec("a", 0, saves)])
    for name, _ in src_layers:  # as vLLM calls it inside the forward, layer by layer
        src.save_layer(name, meta)
    save(src, meta)
    assert (src.take_stats() or {})["saved_chunks"] == 3
    loads = [ChunkOp(op.link, 2, ids) for op, ids in zip(saves, [[0, 2], [4, 8], [9, 10]], strict=True)]
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", loads)])) == set()
    torch.cuda.synchronize()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        for sb, db in [(3, 0), (7, 2), (1, 4), (12, 8), (5, 9), (6, 10)]:
            assert torch.equal(s[sb], d[db])
    src.shutdown()
    dst.shutdown()


def test_cuda_corrupt_chunk_never_reaches_the_device(sidecar_factory) -> None:
    proc = sidecar_factory("64Mi")
    dst_layers = _layers(None)
    src, dst = _workers(proc, _layers(3), dst_layers)
    saves = chunk_ops([[0, 1], [2, 3]])
    save(src, StepPlan(saves=[SaveSpec("a", 0, saves)]))
    client = SidecarClient(proc.info["url"], timeout=5)
    pinned = client.pin([rank_key(saves[1].link, 0)])
    client.arena()[pinned.slots[0].offset + 100] ^= 0x01
    client.release(pinned.lease)
    failed = run_loads(dst, StepPlan(loads=[LoadSpec("b", chunk_ops([[6, 7], [8, 9]]))]))
    assert failed == {8, 9}
    torch.cuda.synchronize()
    for _, d in dst_layers:  # hashed in the private buffer before any DMA: nothing was copied
        assert not d[8].any() and not d[9].any()
    src.shutdown()
    dst.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_round_trips_bit_exact_through_scattered_blocks(sidecar_factory, layout: str) -> None:
    """vLLM's layouts on the GPU (heads outside blocks takes the logical copy), bf16 with random bits
    (NaN payloads included), chunks over blocks that are not consecutive."""
    proc = sidecar_factory("64Mi")
    src_layers = [(f"layer{i}", _cache(layout, torch.bfloat16, 16).to("cuda")) for i in range(2)]
    dst_layers = [(name, torch.zeros_like(t)) for name, t in src_layers]  # zeros_like keeps the strides
    assert all(d.stride() == s.stride() for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True))
    src, dst = _workers(proc, src_layers, dst_layers)
    saves = chunk_ops([[7, 2], [9, 10], [0, 5]])
    meta = StepPlan(saves=[SaveSpec("a", 0, saves)])
    for name, _ in src_layers:
        src.save_layer(name, meta)
    save(src, meta)
    pairs = [(7, 1), (2, 11), (9, 3), (10, 4), (0, 8), (5, 6)]
    loads = [ChunkOp(op.link, 2, [pairs[2 * i][1], pairs[2 * i + 1][1]]) for i, op in enumerate(saves)]
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", loads)])) == set()
    torch.cuda.synchronize()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        for sb, db in pairs:
            assert torch.equal(s[sb].contiguous().view(torch.uint8), d[db].contiguous().view(torch.uint8))
        untouched = [b for b in range(d.shape[0]) if b not in {db for _, db in pairs}]
        assert all(not d[b].contiguous().view(torch.uint8).any() for b in untouched)
    src.shutdown()
    dst.shutdown()


def test_a_layer_is_copied_out_after_the_forward_wrote_it(sidecar_factory) -> None:
    """The forward writes a layer's KV on its stream, possibly long after save_layer is called from
    the host: the side stream's copy must wait for it, not read what was there before."""
    proc = sidecar_factory("64Mi")
    src_layers, dst_layers = _layers(1), _layers(None)
    src, dst = _workers(proc, src_layers, dst_layers)
    saves = chunk_ops([[3, 4]])
    meta = StepPlan(saves=[SaveSpec("a", 0, saves)])
    torch.cuda.synchronize()
    for i, (name, t) in enumerate(src_layers):
        torch.cuda._sleep(50_000_000)  # the forward is still busy (tens of ms) when the host goes on
        t[3:5].fill_(float(i + 1))  # this step's KV, written by the forward
        src.save_layer(name, meta)
    save(src, meta)
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", [ChunkOp(saves[0].link, 2, [8, 9])])])) == set()
    torch.cuda.synchronize()
    for i, (_, d) in enumerate(dst_layers):
        assert bool((d[8:10] == float(i + 1)).all()), f"layer {i} was copied before the forward wrote it"


def test_blocks_reused_after_the_step_do_not_change_its_saves_and_need_no_fence(sidecar_factory) -> None:
    """After finish_step the saves read only their pinned copies: the next step may rewrite the blocks
    at once (no fence waits, even on a hung sidecar), and the chunks stored are the old KV. Three
    steps: a step's first pinned buffer is a cudaHostAlloc, which waits for the whole device and so
    hides the race; the later steps reuse it (without the wait on vLLM's stream they store the new KV)."""
    proc = sidecar_factory("64Mi")
    src_layers, dst_layers = _layers(5), _layers(None)
    src, dst = _workers(proc, src_layers, dst_layers)
    for step in (1, 2, 3):
        before = [t[0:4].clone() for _, t in src_layers]
        saves = chunk_ops([[0, 1], [2, 3]])
        for s in saves:
            s.link = bytes([step]) + s.link[1:]  # each step's chunks under their own keys
        meta = StepPlan(saves=[SaveSpec(f"a{step}", 0, saves)], step=step)
        torch.cuda.synchronize()
        with torch.cuda.stream(src._stream):
            torch.cuda._sleep(200_000_000)  # the side stream is busy: the copies run after finish_step
        for name, _ in src_layers:
            src.save_layer(name, meta)
        proc.popen.send_signal(signal.SIGSTOP)  # the save thread cannot reserve: the saves stay queued
        try:
            src.finish_step(meta)
            assert src.saver.fence(step, wait=5.0) == []  # nothing to wait for, nothing dropped
            for _, t in src_layers:  # the next step's forward rewrites the blocks
                t[0:4].fill_(-1.0)
            torch.cuda.synchronize()
        finally:
            proc.popen.send_signal(signal.SIGCONT)
        assert src.saver.drain(30)
        assert (src.take_stats() or {})["saved_chunks"] == 2
        loads = [ChunkOp(saves[0].link, 2, [8, 9]), ChunkOp(saves[1].link, 2, [10, 11])]
        assert run_loads(dst, StepPlan(loads=[LoadSpec(f"b{step}", loads)])) == set()
        torch.cuda.synchronize()
        for b, (_, d) in zip(before, dst_layers, strict=True):
            assert torch.equal(d[8:12], b), f"step {step} stored the next step's KV"
        for (_, t), b in zip(src_layers, before, strict=True):
            t[0:4].copy_(b)
    src.shutdown()
    dst.shutdown()


def test_two_kv_cache_groups_save_and_load_apart(sidecar_factory) -> None:
    """A hybrid model's groups (here layer 0 and layers 1-2): each chunk holds its group's layers."""
    proc = sidecar_factory("64Mi")
    src_layers, dst_layers = _layers(6), _layers(None)
    src, dst = _workers(proc, src_layers, dst_layers, groups=[[0], [1, 2]])
    a, b = chunk_ops([[1, 2], [5, 6]])
    a.group, b.group = 0, 1
    meta = StepPlan(saves=[SaveSpec("a", 0, [a, b])])
    for name, _ in src_layers:
        src.save_layer(name, meta)
    save(src, meta)
    loads = [ChunkOp(a.link, 2, [10, 11], group=0), ChunkOp(b.link, 2, [12, 13], group=1)]
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", loads)])) == set()
    torch.cuda.synchronize()
    (_, s0), (_, s1), (_, s2) = src_layers
    (_, d0), (_, d1), (_, d2) = dst_layers
    assert torch.equal(d0[10:12], s0[1:3]) and not d0[12:14].any()
    assert torch.equal(d1[12:14], s1[5:7]) and torch.equal(d2[12:14], s2[5:7]) and not d1[10:12].any()
    src.shutdown()
    dst.shutdown()


def test_a_load_writes_its_blocks_after_what_vllm_queued_before_it(sidecar_factory) -> None:
    """vLLM may hand a load blocks the last step's kernels still use (it schedules ahead of the GPU):
    the load's writes wait for what vLLM's stream had queued when the load started. Three loads: the
    first one's new pinned buffer is a cudaHostAlloc, which waits for the whole device and so hides
    the race; the later ones reuse it (without the wait they land under the last step's write)."""
    proc = sidecar_factory("64Mi")
    src_layers, dst_layers = _layers(7), _layers(None)
    src, dst = _workers(proc, src_layers, dst_layers)
    saves = chunk_ops([[2, 3]])
    save(src, StepPlan(saves=[SaveSpec("a", 0, saves)]))
    for attempt in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the last step, still running on vLLM's stream...
        for _, d in dst_layers:
            d[8:10].fill_(-1.0)  # ...writes the blocks the load is about to get
        load = [ChunkOp(saves[0].link, 2, [8, 9])]
        assert run_loads(dst, StepPlan(loads=[LoadSpec(f"b{attempt}", load)])) == set()
        torch.cuda.synchronize()
        for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
            assert torch.equal(d[8:10], s[2:4]), f"load {attempt} landed before the last step's write"
    src.shutdown()
    dst.shutdown()
