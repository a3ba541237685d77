"""The layer-kind registry (models.kinds): every entry is consistent with the spec schema, and
a kind that exists only as a registry entry parses, builds, caches and generates with no edit
to the spec, the builder, the layers or the importer."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from models import SpecError, load_spec
from models.kinds import KINDS, from_hf_layer_type, sections
from models.spec import DEFAULT_WEIGHT_NAMES, ModelSpec
from runtime import LLM, SamplingParams

MIXED = """
name: kinds
vocab_size: 256
hidden_size: 64
layers: {num: 4, pattern: [{kind}, mamba2]}
attention: {num_heads: 4, num_kv_heads: 2, head_dim: 16, sliding_window: 12}
mamba2: {num_heads: 4, head_dim: 16, state_size: 8, chunk_size: 4}
mlp: {intermediate_size: 96}
max_model_len: 96
checkpoint: {source: dummy, seed: 7, init_std: 0.15}
"""


def test_entries_match_the_schema():
    hints = typing.get_type_hints(ModelSpec)
    fields = [f.name for f in dataclasses.fields(ModelSpec)]
    for kind in KINDS.values():
        assert kind.section in fields
        if kind.section_spec is not None:   # its own section: an optional field of its type
            assert hints[kind.section] == typing.Optional[kind.section_spec]
        assert kind.attr in ("self_attn", "mixer")
        assert set(kind.weight_names) <= set(DEFAULT_WEIGHT_NAMES)
    assert [k.section for k in sections()] == ["mamba2", "gated_deltanet", "short_conv", "kda", "mla",
                                               "lightning_attention", "compressed_attention"]
    # the owned sections sit where they always did, so spec_to_dict and YAML keep their order
    assert fields.index("rope_local") + 1 == fields.index("mamba2")
    aliases = [t for k in KINDS.values() for t in k.hf_layer_types]
    assert len(aliases) == len(set(aliases))
    assert from_hf_layer_type("mamba") == "mamba2" and from_hf_layer_type("sliding_attention") == "sliding_attention"


def _generate(path) -> list[list[int]]:
    llm = LLM(path)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_kind_is_one_registry_entry(tmp_path, monkeypatch):
    """`windowed` is sliding_attention under another name, registered only in KINDS: it must
    load, build, get sliding KV groups and give sliding_attention's tokens."""
    monkeypatch.setitem(KINDS, "windowed", dataclasses.replace(KINDS["sliding_attention"], name="windowed"))
    ref, new = tmp_path / "ref.yaml", tmp_path / "new.yaml"
    ref.write_text(MIXED.replace("{kind}", "sliding_attention"))
    new.write_text(MIXED.replace("{kind}", "windowed"))
    assert load_spec(new).layer_kinds == ["windowed", "mamba2"] * 2
    llm = LLM(new)
    kinds = sorted(type(g.spec).__name__ for g in llm.engine.kv_manager.config.groups)
    assert kinds == ["SlidingWindowSpec", "StateSpec"]
    out = _generate(new)
    assert out == _generate(ref) and len({tuple(t) for t in out}) == 2
    # its validation came with it
    bad = tmp_path / "bad.yaml"
    bad.write_text(MIXED.replace("{kind}", "windowed").replace(", sliding_window: 12", ""))
    with pytest.raises(SpecError, match=r"attention\.sliding_window: sliding_attention layers need a window > 0$"):
        load_spec(bad)


def test_unknown_kind_lists_the_registry(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(MIXED.replace("{kind}", "mamba"))
    with pytest.raises(SpecError, match=r"layers\.pattern\[0\]: unknown layer kind 'mamba' \(did you mean 'mamba2'\?\)$"):
        load_spec(path)
