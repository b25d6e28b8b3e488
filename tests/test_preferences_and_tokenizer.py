"""The shipped preference set and the byte tokenizer TRL is given (kt_ops.finetune)."""
from kt_ops.finetune.data.preferences import make_preferences, read_preferences
from kt_ops.finetune.hf_tokenizer import byte_tokenizer
from kt_ops.finetune.tokenizer import ByteTokenizer


def test_shipped_preferences_are_the_generators_output():
    shipped = read_preferences()
    assert shipped == make_preferences() and len(shipped) == 300
    for pair in shipped:
        assert pair["prompt"] and pair["chosen"].startswith(" ") and pair["rejected"].startswith(" ")
        assert pair["chosen"] != pair["rejected"]


def test_hf_byte_tokenizer_has_byte_tokenizers_ids():
    tok, ref = byte_tokenizer(), ByteTokenizer()
    for text in ["Call me Ishmael.", "wörld ✓\n\t  two  spaces", ""]:
        ids = tok(text)["input_ids"]
        assert ids == ref.encode(text) and tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (256, 257, 258, 259)
