"""HF transformers runner, in its own process like the venv peers but with the project venv's
python: ``generate`` on left-padded static batches (``options.mode`` "generate", the HF greedy
reference) or the continuous-batching ``generate_batch`` ("cb").

Why a process of its own: run inside the bench's process, one HF ``generate`` round left our
engine ~20% slower for the rest of that process (prefill and decode steps alike, not undone by
``malloc_trim`` or by deleting the model), which skewed every ratio measured after it.
"""
from __future__ import annotations

import sys


def load(wl: dict):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(int(wl["threads"]))
    opts = wl.get("options", {})
    model = AutoModelForCausalLM.from_pretrained(wl["model_dir"], dtype=torch.float32).eval()
    if opts.get("mode", "generate") == "cb":
        from transformers import ContinuousBatchingConfig
        # Sized explicitly: the default takes 90% of RAM and gets the process killed.
        page, requests = 256, len(wl["prompts"])
        blocks = requests * -(-int(opts["max_tokens_per_request"]) // page) + 8
        cfg = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=2048,
                                       max_requests_per_batch=64, allow_block_sharing=False)
        return "cb", model, cfg
    pad = model.config.pad_token_id
    if pad is None:
        eos = model.config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return "generate", model, (int(pad), int(opts.get("batch", 16)))


def generate(engine, prompts: list, new_tokens: int) -> list:
    import torch
    mode, model, cfg = engine
    with torch.inference_mode():
        if mode == "cb":
            from transformers import GenerationConfig
            gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            out = model.generate_batch(inputs=prompts, generation_config=gc, continuous_batching_config=cfg,
                                       progress_bar=False)
            return [o.generated_tokens for o in out.values()]
        pad, batch = cfg
        results: list[list[int]] = []
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):   # left padding
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad, num_beams=1)
            results.extend(out[:, width:].tolist())
        return results


if __name__ == "__main__":
    import json

    import transformers
    from protocol import serve
    opts = json.loads(open(sys.argv[1]).read()).get("options", {})
    kind = "generate_batch" if opts.get("mode") == "cb" else f"batch {opts.get('batch', 16)}"
    version = f"transformers {transformers.__version__} {kind}"
    sys.exit(serve(load, generate, version))
