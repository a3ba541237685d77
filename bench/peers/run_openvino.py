"""OpenVINO GenAI runner: ``ContinuousBatchingPipeline`` on token-id prompts, fp32 end to end.

The HF checkpoint is exported once with ``optimum-cli export openvino --task
text-generation-with-past --weight-format fp32`` into ``options.cache_dir`` (outside the repo).
Precision is pinned to f32 for both compute (``INFERENCE_PRECISION_HINT``; on AMX / AVX512-BF16
CPUs OpenVINO would otherwise run bf16) and the KV cache (``KV_CACHE_PRECISION``), so the
comparison with our fp32 engine is like for like. Prompts go in as ``ov.Tensor`` token ids.

``options.weight_format`` "int8" or "int4" exports NNCF-compressed weights instead (int8: per
output channel, asymmetric; int4: asymmetric groups of 32 on every linear, ``--ratio 1.0``, the
embedding / head kept int8 as optimum does by default), the counterpart of a GGUF Q8_0 / Q4_1
file in our engine; compute and KV stay f32-pinned, and OpenVINO's own dynamic activation
quantization for compressed weights keeps its default.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


WEIGHT_ARGS = {"fp32": ["--weight-format", "fp32"], "int8": ["--weight-format", "int8"],
               "int4": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"]}


def export_cli() -> str:
    """The ``ov-export`` peer venv's optimum-cli (beside this venv: ``<peers>/ov-export/venv``) where it
    exists, else this venv's: optimum-intel 2.2.0 exports Gemma-2 / Gemma-3 only under transformers
    <= 5.0, older than openvino-genai 2026.4 wants (bench/peers/setup.py)."""
    own = Path(sys.executable).parent / "optimum-cli"
    other = own.parents[3] / "ov-export" / "venv" / "bin" / "optimum-cli"
    return str(other if other.exists() else own)


def export(hf_dir: str, target: Path, weight_format: str = "fp32") -> None:
    if (target / "openvino_model.xml").exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=target.parent))
    try:
        cli = export_cli()
        cmd = [cli, "export", "openvino", "--model", hf_dir, "--task", "text-generation-with-past",
               *WEIGHT_ARGS[weight_format], str(tmp)]
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        if not (tmp / "openvino_model.xml").exists():
            raise RuntimeError(f"optimum-cli export wrote no openvino_model.xml into {tmp}")
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(wl: dict):
    import openvino as ov
    import openvino_genai as ov_genai
    opts = wl.get("options", {})
    fmt = opts.get("weight_format", "fp32")
    if fmt not in WEIGHT_ARGS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_ARGS)}, got {fmt!r}")
    target = Path(opts["cache_dir"]) / f"ir-{fmt}"
    export(wl["model_dir"], target, fmt)
    sc = ov_genai.SchedulerConfig()
    sc.max_num_batched_tokens = int(wl["max_num_batched_tokens"])
    sc.max_num_seqs = int(wl["max_num_seqs"])
    sc.cache_size = int(opts.get("kv_cache_gb", 1))
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = False
    props = {"INFERENCE_NUM_THREADS": int(wl["threads"]), "KV_CACHE_PRECISION": ov.Type.f32,
             "INFERENCE_PRECISION_HINT": ov.Type.f32}
    pipe = ov_genai.ContinuousBatchingPipeline(str(target), sc, "CPU", props)
    return pipe, ov, ov_genai


def generate(engine, prompts: list, new_tokens: int) -> list:
    import numpy as np
    pipe, ov, ov_genai = engine
    gc = ov_genai.GenerationConfig()
    gc.max_new_tokens = new_tokens
    gc.min_new_tokens = new_tokens
    gc.ignore_eos = True
    gc.do_sample = False
    ids = [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]
    results = pipe.generate(ids, [gc] * len(prompts))
    return [list(r.m_generation_ids[0]) for r in results]


if __name__ == "__main__":
    import importlib.metadata
    from protocol import serve
    sys.exit(serve(load, generate, "openvino-genai " + importlib.metadata.version("openvino-genai")))
