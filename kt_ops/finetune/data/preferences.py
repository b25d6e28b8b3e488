"""A small preference set made from the shipped corpus, for DPO on a fresh machine.

Each pair takes one sentence of ``corpus.txt``: the ``prompt`` is its first words, ``chosen``
the words that really follow, ``rejected`` as many words from another sentence. A model
fine-tuned with DPO on it learns to prefer the corpus's own continuations: a task with a
right answer that needs no download. ``preferences.jsonl`` beside this file is
:func:`make_preferences`'s output (``python -m kt_ops.finetune.data.preferences`` writes it
again; a test checks they agree).
"""
from __future__ import annotations

import json
import os
import random

from kt_ops.finetune.data import corpus_sentences

PREFERENCES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preferences.jsonl")
MAX_PROMPT_WORDS = 8
MAX_COMPLETION_WORDS = 6


def _sentences(text: str = None) -> list[list[str]]:
    """The corpus's sentences (split at . ! ? ;), as word lists, those of 6 words or more."""
    return [w for w in (s.split() for s in corpus_sentences(text)) if len(w) >= 6]


def make_preferences(text: str = None, pairs: int = 300, seed: int = 0) -> list[dict]:
    """``pairs`` dicts ``{"prompt", "chosen", "rejected"}`` (completions start with a space)."""
    sentences = _sentences(text)
    rng = random.Random(seed)
    out = []
    while len(out) < pairs:
        i, j = rng.randrange(len(sentences)), rng.randrange(len(sentences))
        if i == j:
            continue
        own, other = sentences[i], sentences[j]
        cut = rng.randint(2, min(MAX_PROMPT_WORDS, len(own) - 2))
        n = min(MAX_COMPLETION_WORDS, len(own) - cut)
        start = rng.randint(0, max(0, len(other) - n))
        chosen, rejected = own[cut:cut + n], other[start:start + n]
        if chosen == rejected:
            continue
        out.append({"prompt": " ".join(own[:cut]), "chosen": " " + " ".join(chosen),
                    "rejected": " " + " ".join(rejected)})
    return out


def read_preferences() -> list[dict]:
    """The shipped preference set (``preferences.jsonl``)."""
    with open(PREFERENCES_PATH, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_preferences(path: str = PREFERENCES_PATH) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for pair in make_preferences():
            f.write(json.dumps(pair, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write_preferences()
    print(f"wrote {PREFERENCES_PATH}")
