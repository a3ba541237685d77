"""Spec parsing: the zoo loads, `extends:` merges, and every user error is one precise line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from models import SpecError, load_spec, resolve_spec
from models.import_hf import main as import_hf_main
from models.spec import spec_to_dict

ZOO = Path(__file__).resolve().parent.parent / "zoo"


def test_zoo_specs_load():
    smol = load_spec(ZOO / "smollm2-135m.yaml")
    assert (smol.num_layers, smol.hidden_size, smol.attention.num_kv_heads) == (30, 576, 3)
    assert smol.layer_kinds == ["full_attention"] * 30
    assert smol.tie_word_embeddings and smol.checkpoint.source == "embedded"


def test_extends_merges_and_overrides():
    tiny = load_spec(ZOO / "smollm2-tiny.yaml")
    assert tiny.hidden_size == 64 and tiny.num_layers == 2
    assert tiny.vocab_size == 49152                     # inherited
    assert tiny.rope.theta == 100000.0                  # inherited nested field
    assert tiny.attention.head_dim == 16                # overridden nested field
    assert tiny.checkpoint.source == "dummy" and tiny.checkpoint.seed == 0


def _write(tmp_path: Path, data, name="x.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def _base() -> dict:
    return spec_to_dict(load_spec(ZOO / "smollm2-tiny.yaml"))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["layers"].update(pattern=["full_attention", "full_attention", "ful"]),
     "layers.pattern[2]: unknown layer kind 'ful' (did you mean 'full_attention'?)"),
    (lambda d: d["layers"].update(kinds=["full_attention"]),
     "layers.kinds: lists 1 layers but layers.num is 2"),
    (lambda d: d["layers"].update(pattern=["mamba2"]),
     "mamba2: layers of kind mamba2 need a 'mamba2:' section"),
    (lambda d: d.update(hiden_size=3), "hiden_size: unknown field (did you mean 'hidden_size'?)"),
    (lambda d: d.pop("vocab_size"), "vocab_size: required field is missing"),
    (lambda d: d["attention"].update(num_heads="four"), "attention.num_heads: expected int, got str 'four'"),
    (lambda d: d["attention"].update(num_kv_heads=3), "attention.num_kv_heads: num_heads 4 is not a multiple"),
    (lambda d: d["mlp"].update(activation="relu"), "mlp.activation: 'relu' is not one of silu, gelu_tanh, gelu"),
    (lambda d: d.update(hidden_size=0), "hidden_size: must be > 0, got 0"),
    (lambda d: d["checkpoint"].update(source="hf", path=None), "checkpoint.path: source 'hf' needs a path"),
    (lambda d: d.update(weight_names={"qq": "x"}), "weight_names.qq: unknown weight key"),
    (lambda d: d["rope"].update(type="ntk"), "rope.type: 'ntk' is not one of"),
])
def test_spec_errors_name_file_and_field(tmp_path, mutate, message):
    data = _base()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    text = str(e.value)
    assert text.startswith(f"{path}: ") and message in text
    assert "\n" not in text


def test_malformed_yaml_names_line(tmp_path):
    path = _write(tmp_path, "name: x\nlayers: [unclosed\nvocab_size: 3\n")
    with pytest.raises(SpecError, match=r"x\.yaml: line \d+, column \d+: malformed YAML"):
        load_spec(path)


def test_yaml_is_safe_loaded(tmp_path):
    path = _write(tmp_path, "name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="malformed YAML"):
        load_spec(path)


def test_extends_cycle_and_missing_base(tmp_path):
    _write(tmp_path, {"extends": "b.yaml"}, "a.yaml")
    _write(tmp_path, {"extends": "a.yaml"}, "b.yaml")
    with pytest.raises(SpecError, match="extends: cycle"):
        load_spec(tmp_path / "a.yaml")
    missing = _write(tmp_path, {"extends": "nope.yaml"}, "c.yaml")
    with pytest.raises(SpecError, match="nope.yaml: cannot read spec"):
        load_spec(missing)


def test_nonexistent_model_path():
    with pytest.raises(SpecError, match="no such spec file or checkpoint directory"):
        resolve_spec("zoo/does-not-exist.yaml")


def test_import_hf_roundtrip(tiny_hf, tmp_path):
    hf_dir, _ = tiny_hf("qwen3")
    derived = resolve_spec(hf_dir)
    assert derived.attention.qk_norm and derived.tie_word_embeddings
    assert (derived.attention.head_dim, derived.num_layers, derived.vocab_size) == (32, 2, 512)
    out = tmp_path / "sub" / "qwen3.yaml"
    out.parent.mkdir()
    assert import_hf_main([str(hf_dir), "-o", str(out)]) == 0
    written = load_spec(out)
    assert not Path(yaml.safe_load(out.read_text())["checkpoint"]["path"]).is_absolute()
    assert written.resolve_path(written.checkpoint.path).resolve() == Path(hf_dir).resolve()
    a, b = spec_to_dict(written), spec_to_dict(derived)
    a["checkpoint"].pop("path"), b["checkpoint"].pop("path")
    assert a == b


def test_import_hf_unknown_family(tmp_path):
    """A model_type we do not list is read field by field like any other; what it lacks, or
    a mechanism it names that we do not have, fails in one line naming the config field."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(SpecError, match=r"config.json: num_hidden_layers: required field is missing \(model_type 'gpt2' "
                                        r"is read as a Llama-style config; known families: llama, "):
        resolve_spec(tmp_path)
    cfg = {"model_type": "newfamily", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "vocab_size": 100, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 30.0}))
    with pytest.raises(SpecError, match=r"config.json: attn_logit_softcapping: 30.0: this mechanism is not supported"):
        resolve_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention", "retention"]}))
    with pytest.raises(SpecError, match=r"config.json: layer_types\[1\]: 'retention' is not a layer kind we have"):
        resolve_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_spec(tmp_path)
    assert spec.layer_kinds == ["full_attention"] * 2 and spec.attention.head_dim == 16


def test_cli_error_is_one_line(tmp_path):
    bad = _write(tmp_path, {**_base(), "layers": {"num": 2, "pattern": ["ful"]}})
    proc = subprocess.run([sys.executable, "-m", "runtime.generate", str(bad), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {bad}: layers.pattern[0]: unknown layer kind 'ful' " \
                                  f"(did you mean 'full_attention'?)"
    assert "Traceback" not in proc.stderr


MAMBA2 = {"num_heads": 4, "head_dim": 16, "state_size": 8}


@pytest.mark.parametrize("layers, extra, message", [
    ({"pattern": ["full_attention+mamba3"]}, {},
     "layers.pattern[0]: unknown layer kind 'mamba3' (did you mean 'mamba2'?)"),
    ({"pattern": ["full_attention+sliding_attention"]}, {},
     "layers.pattern[0]: 'full_attention+sliding_attention': parallel mixers must be of different families "
     "(two would share the layer attribute 'self_attn')"),
    ({"pattern": ["full_attention", "none"], "ffn": ["mlp", "none"]}, {},
     "layers.pattern: layer 1 has neither a token mixer nor a feed-forward block"),
    ({"pattern": ["full_attention"], "ffn": ["mlp", "dense"]}, {},
     "layers.ffn[1]: 'dense' is not one of mlp, moe, none"),
    ({"pattern": ["none"], "ffn": ["moe"]}, {}, "layers.ffn: moe layers need a 'moe:' section"),
    ({"pattern": ["mamba2"]}, {"mamba2": {**MAMBA2, "gated_norm": "after"}},
     "mamba2.gated_norm: 'after' is not one of gate_then_norm, norm_then_gate, none"),
    ({"pattern": ["mamba2"]}, {"mamba2": {**MAMBA2, "n_groups": 3}},
     "mamba2.n_groups: num_heads 4 is not a multiple of n_groups 3"),
    ({"pattern": ["full_attention"]}, {"weight_scales": {"self_attn.k_proj.weight": [[4, 0.5], [2]]}},
     "weight_scales.self_attn.k_proj.weight: expected a number or a list of [rows, scale] pairs, "
     "got [[4, 0.5], [2]]"),
])
def test_layer_structure_errors(tmp_path, layers, extra, message):
    """Parallel mixers, mixer-less / FFN-less layers and their sections: one exact line each."""
    data = {**_base(), **extra}
    data["layers"] = {"num": 2, **layers}
    path = _write(tmp_path, data)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert str(e.value) == f"{path}: {message}"
