"""Runs prompts through the real vLLM engine in this process and writes the results as JSON.

`python -m kvpool_demo.engine_run SPEC.json OUT.json`. The demo, the bench and the engine tests
run it as a child process: each engine gets its own process (vLLM's threads and global state stay
out of the caller) and several runs share one engine start-up.

SPEC: {"model": dir, "block_size": 32, "kv_cache_bytes": N, "max_model_len": N,
       "connector": null | {"name": ..., "module": ..., "extra": {...}}, "scheduling_policy": "fcfs",
       "max_num_batched_tokens": null, "enable_prefix_caching": false, "max_lora_rank": null,
       "tensor_parallel_size": 1, "disable_hybrid_kv_cache_manager": null, "dtype": "float32",
       "kv_events_endpoint": null | "tcp://127.0.0.1:PORT" (vLLM's ZMQ KV events publisher connects there),
       "runs": [{"label": str, "prompts": [[ids], ...], "max_tokens": 4, "priority": [..] | null,
                 "kv_transfer_params": {...} | null, "cache_salt": str | null,
                 "lora": {"name": str, "id": int, "path": dir} | null,
                 "wait_for": path | null, "new_embeddings_seed": int | null,
                 "reset_prefix_cache": null | "engine" | "connector"}, ...]}
A run with "wait_for" starts when that file exists (the caller changes the world between runs);
"new_embeddings_seed" first loads new random token embeddings in place (a weight update, as an RL step
makes one; the in-process engine only), then "reset_prefix_cache" resets vLLM's prefix cache, and
with "connector" the connector's too (its answer is the run's "reset");
after each run "<OUT>.<label>.done" is written. OUT gets {"runs": [{"label", "seconds", "outputs":
[{"token_ids", "logprobs", "num_cached_tokens"}]}]}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _wait_for(path: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine_run: {path} did not appear within {timeout}s")
        time.sleep(0.05)


def build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if spec.get("connector"):
        c = spec["connector"]
        kv_transfer = KVTransferConfig(
            kv_connector=c["name"],
            kv_connector_module_path=c.get("module"),
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=c.get("extra", {}),
        )
    kwargs: dict[str, Any] = {}
    if spec.get("max_lora_rank"):
        kwargs.update(enable_lora=True, max_lora_rank=spec["max_lora_rank"], max_loras=1)
    if spec.get("tensor_parallel_size", 1) > 1:  # one worker process per rank
        kwargs.update(tensor_parallel_size=spec["tensor_parallel_size"], distributed_executor_backend="mp")
    if spec.get("disable_hybrid_kv_cache_manager") is not None:
        kwargs["disable_hybrid_kv_cache_manager"] = spec["disable_hybrid_kv_cache_manager"]
    if spec.get("kv_events_endpoint"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec["kv_events_endpoint"], topic="kv"
        )
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
        kwargs["enable_chunked_prefill"] = True
    return LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=spec.get("block_size", 32),
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 256 << 20),
        max_model_len=spec.get("max_model_len", 4096),
        enforce_eager=True,
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
        scheduling_policy=spec.get("scheduling_policy", "fcfs"),
        kv_transfer_config=kv_transfer,
        seed=0,
        **kwargs,
    )


def _new_embeddings(llm: Any, seed: int) -> None:
    import torch

    def update(model: Any) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.data.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    llm.apply_model(update)


def run_one(llm: Any, run: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    if run.get("new_embeddings_seed") is not None:
        _new_embeddings(llm, run["new_embeddings_seed"])
    reset = None
    if run.get("reset_prefix_cache"):
        reset = llm.reset_prefix_cache(reset_connector=run["reset_prefix_cache"] == "connector")

    extra = {"kv_transfer_params": run["kv_transfer_params"]} if run.get("kv_transfer_params") else None
    params = SamplingParams(
        max_tokens=run.get("max_tokens", 4), temperature=0.0, logprobs=1, ignore_eos=True, extra_args=extra
    )
    salt = {"cache_salt": run["cache_salt"]} if run.get("cache_salt") else {}
    prompts = [{"prompt_token_ids": ids, **salt} for ids in run["prompts"]]
    t0 = time.perf_counter()
    lora = (
        LoRARequest(run["lora"]["name"], run["lora"]["id"], run["lora"]["path"]) if run.get("lora") else None
    )
    outs = llm.generate(prompts, params, priority=run.get("priority"), lora_request=lora, use_tqdm=False)
    seconds = time.perf_counter() - t0
    results = []
    for out in outs:
        comp = out.outputs[0]
        logprobs = [lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs or [], strict=True)]
        results.append(
            {
                "token_ids": list(comp.token_ids),
                "logprobs": logprobs,
                "num_cached_tokens": out.num_cached_tokens or 0,
            }
        )
    return {"label": run.get("label", ""), "seconds": seconds, "outputs": results, "reset": reset}


def publish(out_path: Path, results: list[dict[str, Any]]) -> None:
    """Replaces OUT whole: the caller reads it after an earlier run's done file while the next run
    writes it, and a file written in place can be read empty."""
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps({"runs": results}))
    os.replace(tmp, out_path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    out_path = Path(argv[1])
    llm = build_llm(spec)
    print("engine_run: engine ready", flush=True)
    results = []
    for run in spec["runs"]:
        if run.get("wait_for"):
            _wait_for(run["wait_for"])
        results.append(run_one(llm, run))
        publish(out_path, results)
        Path(f"{out_path}.{run.get('label', len(results))}.done").touch()
        print(f"engine_run: {run.get('label')} done in {results[-1]['seconds']:.3f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
