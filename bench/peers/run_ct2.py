"""CTranslate2 runner: ``Generator.generate_batch`` greedy, float32, prompts as token strings.

The HF checkpoint is converted once with ``ct2-transformers-converter --quantization float32``
into ``options.cache_dir``. CTranslate2 takes prompts as token strings, so ids are mapped
through the converted model's ``vocabulary.json`` (one string per id) and results are read
back as ``sequences_ids``. ``include_prompt_in_result=False`` feeds each prompt as a block (its
fast path); ``end_token=[]`` plus ``min_length`` keeps EOS from stopping a request early.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def convert(hf_dir: str, target: Path) -> None:
    if (target / "model.bin").exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    out = tmp / "model"
    try:
        cli = str(Path(sys.executable).parent / "ct2-transformers-converter")
        cmd = [cli, "--model", hf_dir, "--output_dir", str(out), "--quantization", "float32"]
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        out.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(wl: dict):
    import ctranslate2
    opts = wl.get("options", {})
    target = Path(opts["cache_dir"]) / "ct2-fp32"
    convert(wl["model_dir"], target)
    vocab = json.loads((target / "vocabulary.json").read_text())
    gen = ctranslate2.Generator(str(target), device="cpu", compute_type="float32",
                                intra_threads=int(wl["threads"]), inter_threads=1)
    return gen, vocab, int(opts.get("ct2_max_batch_size", 0))


def generate(engine, prompts: list, new_tokens: int) -> list:
    gen, vocab, max_batch = engine
    tokens = [[vocab[t] for t in p] for p in prompts]
    results = gen.generate_batch(tokens, max_batch_size=max_batch, beam_size=1, sampling_topk=1,
                                 max_length=new_tokens, min_length=new_tokens, end_token=[],
                                 include_prompt_in_result=False)
    return [list(r.sequences_ids[0]) for r in results]


if __name__ == "__main__":
    import importlib.metadata
    from protocol import serve
    sys.exit(serve(load, generate, "ctranslate2 " + importlib.metadata.version("ctranslate2")))
