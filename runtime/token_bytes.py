"""The bytes a token stands for, for OpenAI's `logprobs.content[].bytes`.

A token's decoded text is not its bytes: a byte-fallback token (`<0xE6>`) or a piece of a
multi-byte UTF-8 character split across tokens decodes alone to U+FFFD, whose UTF-8 bytes
say nothing about the token. The client needs the token's own bytes so that concatenating
them over a response rebuilds the exact UTF-8 text. They come from the token's vocabulary
string under the tokenizer's decoder:
- byte-level BPE (GPT-2, Llama 3, SmolLM2): each character of the string is one byte in
  GPT-2's printable byte alphabet, mapped back here;
- SentencePiece-style BPE (Llama 2, Gemma): `<0xNN>` byte-fallback tokens are byte NN; any
  other piece is its text with the decoder's replacements (`▁` -> space) applied;
- added tokens (specials such as `<|im_end|>`) are their content as written.
Spelled once per token id and cached; the server calls this on its own thread, which only
reads the tokenizer.
"""
from __future__ import annotations

import json
import re

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(b)
        else:
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in enumerate(chars)}


def _decoders(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    return [d for sub in decoder.get("decoders", [decoder]) for d in _decoders(sub)] \
        if decoder.get("type") == "Sequence" else [decoder]


class TokenBytes:
    """token id -> the bytes it stands for (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        self._added = {tid: tok.content for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)     # its JSON alone, not the whole vocabulary's
        decoders = _decoders(json.loads(decoder.__getstate__())) if decoder is not None else []
        types = {d.get("type") for d in decoders}
        self._byte_level = _gpt2_byte_decoder() if "ByteLevel" in types else None
        self._byte_fallback = "ByteFallback" in types
        self._replace = [(d["pattern"]["String"], d["content"]) for d in decoders
                         if d.get("type") == "Replace" and "String" in d.get("pattern", {})]
        # Metaspace decoders spell the word boundary as a replacement of their own.
        self._replace += [(d.get("replacement", "▁"), " ") for d in decoders if d.get("type") == "Metaspace"]
        self._known = backend is not None

    def __call__(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._spell(token_id)
        return got

    def _spell(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        if not self._known:     # a tokenizer without a readable decoder: its decoded text
            return self.tokenizer.decode([token_id]).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if self._byte_fallback:
            m = _BYTE_FALLBACK.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        for pattern, content in self._replace:
            piece = piece.replace(pattern, content)
        return piece.encode()
