"""Chunk keys and the connector's configuration."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvpool_connector.config import KVPoolConfig, load_config
from kvpool_connector.connector import check_failure_policy
from kvpool_connector.keys import Namespace, chain, chunk_keys, chunk_link, rank_key, tail_links
from kvpool_connector.spans import decode_spans, prompt_spans

NS = Namespace("m", "float32", "FullAttentionSpec:LBHNC", 8, 4, 64, 32, 64, 1)


def test_keys_are_chained_hex_and_prefix_stable() -> None:
    tokens = list(range(300))
    keys = chunk_keys(NS, tokens)
    assert len(keys) == 5  # four full chunks of 64 and a partial one
    assert all(len(k) == 32 and k == k.lower() and int(k, 16) >= 0 for k in keys)
    assert chunk_keys(NS, tokens[:256]) == keys[:4]  # a shared prefix gives the same keys
    changed = tokens.copy()
    changed[10] = 999
    # a change in chunk 0 changes every later key (chained)
    assert all(a != b for a, b in zip(chunk_keys(NS, changed), keys, strict=True))


def test_namespace_separates_everything_that_changes_bytes() -> None:
    tokens = list(range(128))
    base = chunk_keys(NS, tokens)
    cases: list[tuple[str, Any]] = [
        ("model", "other"),
        ("dtype", "bfloat16"),
        ("layout", "x"),
        ("num_layers", 9),
        ("num_kv_heads", 8),
        ("head_size", 128),
        ("block_size", 16),
        ("chunk_size", 128),
        ("tp_size", 2),
        ("tp_replicated", True),
        ("pp_size", 2),
        ("dcp_size", 2),
        ("pcp_size", 2),
        ("kv_cache_dtype", "fp8_e4m3"),
        ("quantization", "fp8"),
        ("weights", "files:0123"),
        ("overrides", '{"rope_theta":5000.0}'),
    ]
    for field, value in cases:
        assert chunk_keys(dataclasses.replace(NS, **{field: value}), tokens)[0] != base[0], field
    assert chunk_keys(NS, tokens, rank=1)[0] != base[0]


def test_every_namespace_field_enters_the_seed() -> None:
    checked = {"model", "dtype", "layout", "num_layers", "num_kv_heads", "head_size", "block_size"}
    checked |= {"chunk_size", "tp_size", "pp_size", "dcp_size", "pcp_size", "kv_cache_dtype"}
    checked |= {"quantization", "weights", "overrides", "tp_replicated"}
    assert {f.name for f in dataclasses.fields(Namespace)} == checked  # a new field needs a case above


def test_extra_inputs_change_keys_from_their_chunk_on_and_only_there() -> None:
    tokens = list(range(64 * 3))
    plain = chunk_keys(NS, tokens)
    salted = chunk_keys(NS, tokens, extras=lambda start, end: b"salt" if start == 0 else None)
    assert all(a != b for a, b in zip(plain, salted, strict=True))  # the chain carries it on
    image = chunk_keys(NS, tokens, extras=lambda start, end: b"img" if start == 64 else None)
    assert image[0] == plain[0] and image[1] != plain[1] and image[2] != plain[2]
    assert chunk_keys(NS, tokens, extras=lambda start, end: None) == plain  # no extras: plain keys
    other = chunk_keys(NS, tokens, extras=lambda start, end: b"img2" if start == 64 else None)
    assert other[1] != image[1]


def test_extra_key_encoding_is_canonical_and_refuses_what_it_cannot_encode() -> None:
    from kvpool_connector.request_inputs import Unkeyable, encode_extra

    a = (("lora", "ad", "/p"), ("mm", "h1", 3), ("cache_salt", "t"), ("prompt_embeds", b"\x01"))
    assert encode_extra(a) == encode_extra(a)
    distinct = [("a", "bc"), ("ab", "c"), ("1",), (1,), (b"1",), (True,), (None,), (("a",),), ("a",)]
    assert len({encode_extra(v) for v in distinct}) == len(distinct)
    with pytest.raises(Unkeyable, match="float"):
        encode_extra((("mm", 1.5, 0),))


def test_incremental_chain_equals_full_chain() -> None:
    tokens = list(range(64 * 6))
    full = chain(NS.seed(), tokens, 64)
    part = chain(NS.seed(), tokens[: 64 * 2], 64)
    part += chain(NS.seed(), tokens, 64, start=part[-1], first_chunk=2)
    assert part == full
    assert rank_key(full[0], 0) == chunk_keys(NS, tokens)[0]


def test_a_chunks_tails_hashed_in_one_pass_are_each_tails_own_link() -> None:
    tokens = list(range(1000, 1256))
    prev = chain(NS.seed(), list(range(256)), 256)[0]
    ends = [240, 16, 128, 128, 1]  # any order, repeats
    assert tail_links(prev, tokens, ends) == [chunk_link(prev, tokens[:end]) for end in ends]
    assert tail_links(prev, tokens, []) == []


def test_keys_do_not_change_between_versions() -> None:
    """Chunks stored by pods of an earlier kvpool are found by a newer one (a rolling upgrade keeps
    the Redis tier and a sidecar's arena warm): these keys were made by the code before chunk_link,
    a salted chunk's and a block prefix of it (a shorter tail a lookup asks for) among them."""
    tokens = list(range(160))

    def salt(start: int, end: int) -> bytes | None:
        return b"salt" if start == 64 else None

    links = chain(NS.seed(), tokens, 64, extras=salt)
    assert [rank_key(link, 0) for link in links] == [
        "29ab58fa7094b50dba66e0dc9f76c6a0",
        "ac412ba9f34c86691f7ec1d346bf0514",
        "a86a7a41748662be7bb466174f5c4972",  # the partial chunk [128,160)
    ]
    block_prefix = chunk_link(links[0], tokens[64:96], salt(64, 96))  # [64,96): the scheduler's tail link
    assert rank_key(block_prefix, 0) == "8c3ef78c52c5f388d76eebaf22a4d3a0"


def test_spans() -> None:
    cfg = KVPoolConfig(chunk_size=64)
    assert prompt_spans(150, cfg, 32) == [(0, 64), (64, 128)]  # tail 128..150 is less than a block
    assert prompt_spans(170, cfg, 32) == [(0, 64), (64, 128), (128, 160)]
    assert prompt_spans(170, dataclasses.replace(cfg, discard_partial_chunks=True), 32) == [
        (0, 64),
        (64, 128),
    ]
    assert prompt_spans(170, dataclasses.replace(cfg, skip_last_n_tokens=20), 32) == [(0, 64), (64, 128)]
    assert decode_spans(300, 170, cfg) == [(128, 192), (192, 256)]


def test_load_config_defaults_types_and_unknown_keys() -> None:
    cfg, warnings = load_config(None)
    assert cfg == KVPoolConfig() and warnings == []
    cfg, warnings = load_config({"chunk_size": 512, "priority_limit": 3, "pool": "ns/p", "lmcache_thing": 1})
    assert cfg.chunk_size == 512 and cfg.priority_limit == 3 and cfg.pool == "ns/p"
    assert len(warnings) == 1 and "lmcache_thing" in warnings[0]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("chunk_size", "256"),
        ("chunk_size", 0),
        ("chunk_size", True),
        ("timeout_ms", -1),
        ("save_decode_cache", 1),
        ("priority_limit", 1.5),
        ("sidecar_url", "127.0.0.1:7070"),
        ("sidecar_url", "https://127.0.0.1:7070"),  # the client speaks plain HTTP: refused here, not at start
        ("skip_last_n_tokens", -2),
        ("shm_path", 3),
        ("copy_threads", 0),
        ("copy_threads", True),
        ("save_process", 1),
        ("save_wait_ms", 0),
    ],
)
def test_load_config_rejects_wrong_values_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        load_config({key: value})


def test_every_key_is_in_the_readme_table_and_the_design() -> None:
    """A user learns the keys from README.md's table; docs/DESIGN.md is the contract between the parts."""
    root = Path(__file__).resolve().parents[2]
    readme, design = (root / "README.md").read_text(), (root / "docs" / "DESIGN.md").read_text()
    for f in dataclasses.fields(KVPoolConfig):
        assert f"| `{f.name}` |" in readme, f"README.md's table lacks {f.name}"
        assert f"`{f.name}`" in design, f"docs/DESIGN.md lacks {f.name}"


def test_config_module_imports_without_torch_or_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvpool_connector.config, kvpool_connector.keys, kvpool_connector.spans;"
        "bad = {'torch', 'vllm'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_connector_refuses_vllms_default_failure_policy() -> None:
    """vLLM's default `fail` turns every cache race (a chunk evicted between lookup and load) into a
    failed user request: the connector refuses to start with it and says what to set."""
    from vllm.config import KVTransferConfig

    def config(**policy: Any) -> KVTransferConfig:
        return KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_both", **policy)

    check_failure_policy(config(kv_load_failure_policy="recompute"))
    for refused in (config(), config(kv_load_failure_policy="fail")):
        with pytest.raises(ValueError, match="kv_load_failure_policy='recompute'"):
            check_failure_policy(refused)
