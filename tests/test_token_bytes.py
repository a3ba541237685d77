"""Token bytes for chat logprobs (runtime/token_bytes.py): every token's bytes equal
xgrammar's decoded vocabulary (its own reading of the tokenizer), and the bytes of a text's
tokens laid end to end are the text's UTF-8, byte-fallback and split characters included."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from models.embedded import ensure_embedded
from runtime.token_bytes import TokenBytes

# Split characters for both: SmolLM2 (byte-level) splits CJK and emoji, Gemma 3 spells the rare
# ones (ꙮ, 𠀋) with byte-fallback tokens.
TEXT = "héllo 日本語 😀 naïve ☃ ꙮ 𠀋 ok"


@pytest.fixture(scope="module")
def tokenizers():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = AutoTokenizer.from_pretrained(str(ensure_embedded(name)))
        return cache[name]
    return get


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_token_bytes_rebuild_the_utf8_text(tokenizers, name):
    tok = tokenizers(name)
    tb = TokenBytes(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tb(t) for t in ids]
    assert b"".join(pieces) == TEXT.encode()
    # Tokens holding part of a character decode alone to U+FFFD; their bytes are the real ones.
    split = [(t, p) for t, p in zip(ids, pieces) if "\ufffd" in tok.decode([t])]
    assert split and all(p != tok.decode([t]).encode() for t, p in split)
    special = tok.convert_tokens_to_ids(tok.eos_token)
    assert tb(special) == tok.eos_token.encode()


def test_byte_fallback_tokens_are_their_byte(tokenizers):
    tok = tokenizers("gemma3-270m")
    tb = TokenBytes(tok)
    for b in (0x00, 0x0A, 0xE6, 0xFF):
        tid = tok.convert_tokens_to_ids(f"<0x{b:02X}>")
        assert tok.decode([tid]) in ("\ufffd", chr(b)) and tb(tid) == bytes([b])


def _equal_to_xgrammar(tok):
    import xgrammar as xgr
    vocab = xgr.TokenizerInfo.from_huggingface(tok).decoded_vocab
    tb = TokenBytes(tok)
    assert [tb(i) for i in range(len(vocab))] == list(vocab)


def test_every_smollm2_token_equals_xgrammar(tokenizers):
    _equal_to_xgrammar(tokenizers("smollm2-135m"))


@pytest.mark.slow
def test_every_gemma3_token_equals_xgrammar(tokenizers):    # 262k tokens: xgrammar takes ~20 s
    _equal_to_xgrammar(tokenizers("gemma3-270m"))
