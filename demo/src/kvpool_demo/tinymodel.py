"""A random-weight Llama (a Mistral with sliding windows, a DeepSeek-V2 with MLA) and a small trained
tokenizer in a directory, for the demo, tests and bench.

Nothing is downloaded: the weights come from transformers' configs with a fixed seed, the
tokenizer is trained with `tokenizers` on a few generated sentences.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 512
    max_positions: int = 4096
    sliding_window: int | None = None  # set: a Mistral whose every layer attends this many tokens back
    # with sliding_window: every n-th layer attends to all tokens (Gemma 2 and gpt-oss: 2; Gemma 3: 6)
    full_attention_every: int | None = None
    # a DeepSeek-V2 with multi-head latent attention: each layer caches one latent vector per token
    # (512 + 64 rotary dims: the only size vLLM's CPU MLA kernel takes), the same on every TP rank
    mla: bool = False
    # a Llama 4: chunked local attention (each token attends within its own `attention_chunk`-token
    # chunk) on every layer but every fourth, which attends to all tokens
    attention_chunk: int | None = None
    # a Qwen3-Next: gated delta net (linear attention, one running state per request, not per-token
    # KV) and full attention layers alternate, each MLP a mixture of experts; bfloat16 on the CPU
    gdn: bool = False

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's K and V take in vLLM's cache, float32, over all layers."""
        if self.mla:
            return self.layers * (MLA_LATENT + MLA_ROPE) * 4
        return 2 * self.layers * self.kv_heads * self.head_size * 4


MLA_LATENT, MLA_ROPE = 512, 64


TINY = ModelShape()  # head size 64: the CPU backend's smallest common size
TINY_SWA = ModelShape(sliding_window=64)  # a sliding window of two 32-token blocks
# Gemma 2-style: windowed and full layers alternate (vLLM's hybrid KV cache manager: two groups)
TINY_HYBRID = ModelShape(layers=4, sliding_window=64, full_attention_every=2)
TINY_CHUNKED = ModelShape(layers=4, attention_chunk=64)  # Llama 4-style: 3 chunked local layers, 1 full
TINY_GDN = ModelShape(gdn=True)  # vLLM's CPU engine runs it in bfloat16 only
TINY_MLA = ModelShape(heads=4, kv_heads=4, mla=True)  # vLLM's CPU engine runs it with block size 16
# the demo's: big enough that a 2,000-token prefill takes a visible fraction of a second
DEMO = ModelShape(hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1408, vocab=512)
# the shape the bench uses: prefill of 2,000 tokens costs seconds on 2 cores
BENCH = ModelShape(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, vocab=512)
# the same as a hybrid (Gemma 2 and gpt-oss): windowed and full layers alternate. Its window (512 tokens)
# is longer than bench opt_out's prompts, so each chunk's part in each group is saved and counted.
BENCH_HYBRID = replace(BENCH, sliding_window=512, full_attention_every=2)


def make_model(directory: Path, shape: ModelShape = TINY, seed: int = 0) -> Path:
    """Writes the model and tokenizer into `directory` (reused when already there) and returns it."""
    directory = Path(directory)
    marker = directory / "kvpool-shape.json"
    made = {**asdict(shape), "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == made:
        return directory
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    _make_tokenizer(directory, shape.vocab)
    torch.manual_seed(seed)
    if shape.mla:
        model = _mla_model(shape)
    elif shape.gdn:
        model = _gdn_model(shape)
    elif shape.attention_chunk:
        model = _llama4_model(shape)
    else:
        model = _llama_model(shape)
    model.save_pretrained(directory, safe_serialization=True)
    marker.write_text(json.dumps(made))
    return directory


def _config(shape: ModelShape) -> dict[str, Any]:
    """What every tiny model's transformers config takes from its shape."""
    return {
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "intermediate_size": shape.intermediate,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


def _llama_model(shape: ModelShape) -> Any:
    """A Llama, or a Mistral when it has a sliding window."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    swa = shape.sliding_window is not None
    llama = (LlamaConfig, LlamaForCausalLM)
    config_class, model_class = (MistralConfig, MistralForCausalLM) if swa else llama
    window: dict[str, Any] = {"sliding_window": shape.sliding_window} if swa else {}
    if every := shape.full_attention_every:  # read by vLLM's Llama family per layer
        kinds = (
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(shape.layers)
        )
        window["layer_types"] = list(kinds)
    config = config_class(**_config(shape), **window)
    return model_class(config).float()


def _mla_model(shape: ModelShape) -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        **_config(shape),
        kv_lora_rank=MLA_LATENT,
        qk_rope_head_dim=MLA_ROPE,
        q_lora_rank=None,
        qk_nope_head_dim=shape.head_size,
        v_head_dim=shape.head_size,
        first_k_dense_replace=shape.layers,  # dense MLPs: no experts
    )
    return DeepseekV2ForCausalLM(config).float()


def _llama4_model(shape: ModelShape) -> Any:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        **_config(shape),
        head_dim=shape.head_size,
        intermediate_size_mlp=shape.intermediate,
        attention_chunk_size=shape.attention_chunk,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(shape.layers)],  # 0: a full-attention layer
        interleave_moe_layer_step=0,  # dense MLPs
        moe_layers=[],
        use_qk_norm=False,
    )
    return Llama4ForCausalLM(config).float()


def _gdn_model(shape: ModelShape) -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **_config(shape),
        head_dim=shape.head_size,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(shape.layers)],
        linear_num_value_heads=shape.heads,
        linear_num_key_heads=shape.kv_heads,
        linear_key_head_dim=shape.head_size,
        linear_value_head_dim=shape.head_size,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=shape.intermediate // 4,
        shared_expert_intermediate_size=shape.intermediate // 4,
    )
    return Qwen3NextForCausalLM(config).float()


def make_lora(directory: Path, base: Path, shape: ModelShape = TINY, seed: int = 0, rank: int = 8) -> Path:
    """A random LoRA adapter (PEFT's format) on q, k and v of every layer of the model at `base`."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": ["q_proj", "k_proj", "v_proj"],
        "base_model_name_or_path": str(base),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    kv = shape.kv_heads * shape.head_size
    weights = {}
    for layer in range(shape.layers):
        for name, out in (("q_proj", shape.hidden), ("k_proj", kv), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, shape.hidden, generator=g) * 0.1
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.1
    save_file(weights, str(directory / "adapter_model.safetensors"))
    return directory


def _make_tokenizer(directory: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
        for _ in range(400)
    ]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(directory)


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """Token ids that avoid the special tokens (0..3)."""
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(length)]
