"""Bad inputs give one clear error and leave the engine usable with every block free."""
from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from models import WeightError, resolve_spec
from models.spec import spec_to_dict
from runtime import LLM, SamplingParams


def _copy_ckpt(tiny_hf, tmp_path):
    src, _ = tiny_hf("llama")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor(tiny_hf, tmp_path):
    ckpt = _copy_ckpt(tiny_hf, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(WeightError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight$"):
        LLM(ckpt)


def test_unexpected_tensor(tiny_hf, tmp_path):
    ckpt = _copy_ckpt(tiny_hf, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(WeightError, match=r"unexpected tensors \(not in the spec\): model\.layers\.0\.mystery\.weight"):
        LLM(ckpt)


def test_wrong_tensor_shape(tiny_hf, tmp_path):
    ckpt = _copy_ckpt(tiny_hf, tmp_path)
    data = spec_to_dict(resolve_spec(ckpt))
    data["mlp"]["intermediate_size"] = 96
    spec = tmp_path / "wrong.yaml"
    spec.write_text(yaml.safe_dump(data))
    with pytest.raises(WeightError, match=r"model\.safetensors: tensor 'model\.layers\.\d\.mlp\.(gate_proj|up_proj|down_proj)\.weight' "
                                          r"has shape \[(128, 64|64, 128)\], the spec expects \[(96, 64|64, 96)\]$"):
        LLM(spec)


def test_no_pickles_loaded(tiny_hf, tmp_path):
    ckpt = _copy_ckpt(tiny_hf, tmp_path)
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(WeightError, match="no \\*.safetensors files"):
        LLM(ckpt)


@pytest.mark.parametrize("damage", ["truncated", "random", "empty", "header"])
def test_unreadable_safetensors_is_one_line_naming_the_file(tiny_hf, tmp_path, damage):
    ckpt = _copy_ckpt(tiny_hf, tmp_path)
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncated": data[: len(data) // 2], "random": torch.randint(0, 256, (4096,),
                      dtype=torch.uint8).numpy().tobytes(), "empty": b"",
                      "header": data[:8] + b"{not json" + data[17:]}[damage])
    with pytest.raises(WeightError) as e:
        LLM(ckpt)
    message = str(e.value)
    assert message.startswith(f"{file}: not a readable safetensors file (") and "\n" not in message, message


def test_index_listing_a_missing_shard(tiny_hf, tmp_path):
    ckpt = _copy_ckpt(tiny_hf, tmp_path)
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00002.safetensors"}}')
    with pytest.raises(WeightError, match=r"index\.json: lists files that are not there: model-00002\.safetensors$"):
        LLM(ckpt)


@pytest.fixture(scope="module")
def llm(tiny_hf):
    path, _ = tiny_hf("llama")
    return LLM(path, max_model_len=64)


def _assert_clean(llm):
    s = llm.kv_cache_stats()
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == s["num_waiting"] == 0


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": list(range(64))}, "prompt has 64 tokens; max_model_len is 64"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [1, 512]}, "prompt token ids must be in [0, 512)"),
    ({"prompt_token_ids": [1, "a"]}, "prompt_token_ids must be a list of ints"),
    ("a text prompt", "this model has no tokenizer"),
    (42, "a prompt is a string or {'prompt_token_ids': [...]}"),
])
def test_bad_prompt_schedules_nothing(llm, prompt, message):
    good = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError) as e:
        llm.generate([good, prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert message in str(e.value)
    _assert_clean(llm)
    out = llm.generate(good, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    _assert_clean(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(seed=-1), "seed"),
    (dict(logprobs=-2), "logprobs"), (dict(n=65), "n"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: "):
        SamplingParams(**kwargs)


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="got 2 prompts but 1 sampling params"):
        llm.generate([{"prompt_token_ids": [1]}] * 2, [SamplingParams()], use_tqdm=False)


def test_unknown_llm_argument(tiny_hf):
    with pytest.raises(TypeError, match="unknown argument\\(s\\): max_num_seq;"):
        LLM(tiny_hf("llama")[0], max_num_seq=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_kv_blocks=3), "cannot hold one request of 64 tokens"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(max_model_len=100000), "exceeds the model's 512"),
    (dict(attention_backend="cuda-magic"), "unknown attention backend 'cuda-magic'"),
])
def test_bad_engine_config(tiny_hf, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(tiny_hf("llama")[0], **{"max_model_len": 64, **kwargs})


def test_abort_frees_blocks(llm):
    engine = llm.engine
    reqs = [engine.make_request({"prompt_token_ids": list(range(1, 30))}, SamplingParams(max_tokens=20))
            for _ in range(3)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    engine.step()
    assert llm.kv_cache_stats()["num_free_blocks"] < llm.kv_cache_stats()["num_blocks"]
    engine.abort([r.request_id for r in reqs])
    engine.step()   # lets the runner drop the aborted rows
    _assert_clean(llm)
    assert engine.runner.batch.num_reqs == 0
