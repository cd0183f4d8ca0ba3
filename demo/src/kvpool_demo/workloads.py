"""Request sequences shaped like the workloads an offload tier is measured on (LMCache's multi-round
QA and long-document QA, vLLM's prefix_repetition dataset), at CPU scale, as token ids.

Each is a list of turns in the order they are sent; a turn's `round` says how many times its user,
prefix or document has been seen (1: the first time), which is what TTFT is reported by. Answers in
a conversation's history are fixed tokens, not the model's output, so every arm sends the same
prompts whatever it generates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    user: int  # the user, prefix or document the turn belongs to
    round: int  # 1 the first time that user/prefix/document is seen
    prompt: list[int]
    max_tokens: int


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]  # 0..3 are the tokenizer's special tokens


def multi_round_qa(
    users: int, rounds: int, system: int, history: int, question: int, answer: int, vocab: int, seed: int
) -> list[Turn]:
    """Users sharing a system prompt, each with a long history of its own, asking `rounds` questions;
    users take turns, so a user returns only after every other user has asked."""
    rng = random.Random(seed)
    shared = _tokens(rng, system, vocab)
    context = [shared + _tokens(rng, history, vocab) for _ in range(users)]
    turns = []
    for r in range(1, rounds + 1):
        for u in range(users):
            context[u] += _tokens(rng, question, vocab)
            turns.append(Turn(u, r, list(context[u]), answer))
            context[u] += _tokens(rng, answer, vocab)  # the answer stays in the history
    return turns


def prefix_repetition(
    prefixes: int, per_prefix: int, prefix: int, suffix: int, answer: int, vocab: int, seed: int
) -> list[Turn]:
    """`per_prefix` prompts on each of `prefixes` long prefixes, each with its own suffix, shuffled."""
    rng = random.Random(seed)
    heads = [_tokens(rng, prefix, vocab) for _ in range(prefixes)]
    order = [p for p in range(prefixes) for _ in range(per_prefix)]
    rng.shuffle(order)
    seen = [0] * prefixes
    turns = []
    for p in order:
        seen[p] += 1
        turns.append(Turn(p, seen[p], heads[p] + _tokens(rng, suffix, vocab), answer))
    return turns


def long_doc_qa(docs: int, doc: int, question: int, answer: int, vocab: int, seed: int) -> list[Turn]:
    """Every document with a question, then every document again with another, in the same order:
    each comes back only after all the others, the order worst for an LRU cache (LMCache's "tile")."""
    rng = random.Random(seed)
    texts = [_tokens(rng, doc, vocab) for _ in range(docs)]
    return [Turn(d, r, texts[d] + _tokens(rng, question, vocab), answer) for r in (1, 2) for d in range(docs)]


def no_reuse(prompts: int, length: int, answer: int, vocab: int, seed: int) -> list[Turn]:
    """Unique prompts only: a cache tier can only cost here."""
    rng = random.Random(seed)
    return [Turn(i, 1, _tokens(rng, length, vocab), answer) for i in range(prompts)]


def reusable_tokens(turns: list[Turn], block_size: int) -> list[int]:
    """Per turn, the tokens an ideal cache could serve: the longest prefix shared with an earlier
    prompt, in whole blocks and never the prompt's last token (vLLM always computes it)."""
    out = []
    for i, t in enumerate(turns):
        best = 0
        for earlier in turns[:i]:
            n = 0
            for a, b in zip(earlier.prompt, t.prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        best = min(best, len(t.prompt) - 1)
        out.append(best - best % block_size)
    return out
