"""The byte-level tokenizer (:mod:`kt_ops.finetune.tokenizer`) as a transformers tokenizer.

TRL's trainers take a ``transformers`` tokenizer (``processing_class``). This one has the same
ids as :class:`~kt_ops.finetune.tokenizer.ByteTokenizer`: 0-255 the UTF-8 bytes, then ``<bos>``
(256), ``<eos>`` (257) and ``<pad>`` (258); built in memory from the ``tokenizers`` library
(a byte-level BPE with no merges), so nothing is downloaded.
"""
from __future__ import annotations

from kt_ops.finetune.tokenizer import ByteTokenizer


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` with ByteTokenizer's ids (vocab 259), eos appended to each
    sequence TRL tokenizes as a completion."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()  # byte -> the printable character byte-level BPE uses for it
    vocab = {byte_chars[b]: b for b in range(ByteTokenizer.num_bytes)}
    specials = {"<bos>": ByteTokenizer.bos_token_id, "<eos>": ByteTokenizer.eos_token_id,
                "<pad>": ByteTokenizer.pad_token_id}
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   model_max_length=4096)
