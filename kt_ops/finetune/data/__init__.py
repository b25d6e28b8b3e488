"""Data shipped with kt_ops.

``corpus.txt``: about 8.5 KB of public-domain English prose for the ``kt_ops.finetune`` demo
(excerpts of Lincoln's Gettysburg Address, 1863; Dickens, *A Tale of Two Cities*, 1859;
Austen, *Pride and Prejudice*, 1813; Melville, *Moby-Dick*, 1851; Carroll, *Alice's
Adventures in Wonderland*, 1865; the Declaration of Independence, 1776; Genesis 1:1-5 in the
King James Version; two of Aesop's fables in G. F. Townsend's style).
"""
import os
import re

CORPUS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt")


def read_corpus() -> str:
    """The default fine-tuning corpus as one string."""
    with open(CORPUS_PATH, encoding="utf-8") as f:
        return f.read()


def corpus_sentences(text: str = None) -> list[str]:
    """The corpus (or ``text``) as sentences, split after . ! ? ; with whitespace collapsed."""
    return re.split(r"(?<=[.!?;])\s+", " ".join((read_corpus() if text is None else text).split()))
