"""One-off offline generation: `python -m runtime.generate <spec.yaml | hf_dir> --prompt ...`.

`--chat` wraps each prompt in the tokenizer's chat template (as a user message), which is
what instruction-tuned models such as the embedded SmolLM2 expect.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from models import SpecError, WeightError
from runtime.beam_search import BeamSearchParams
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="zoo YAML spec or HF checkpoint directory")
    ap.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    ap.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model forward")
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument("--attention-backend", default="torch", help="torch (default), triton or flashinfer")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--no-prepack-weights", action="store_true", help="CPU: plain F.linear instead of pre-packed weights (models/prepack.py)")
    ap.add_argument("--quantization", default=None, help="linear weights: none, gguf, int8, int4, int4_asym "
                    "(default: the spec's quantization.method; models/quant_load.py)")
    ap.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams (greedy sampling off)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        t0 = time.perf_counter()
        llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  compile=args.compile, compile_cache_dir=args.compile_cache_dir,
                  attention_backend=args.attention_backend, device=args.device, dtype=args.dtype,
                  prepack_weights=not args.no_prepack_weights, quantization=args.quantization)
        print(f"[loaded in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
        prompts = args.prompt
        tok = llm.get_tokenizer()
        if args.chat:
            if tok is None or not getattr(tok, "chat_template", None):
                raise ValueError("--chat needs a tokenizer with a chat template")
            prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
        t0 = time.perf_counter()
        if args.beam_width:
            beams = llm.beam_search(prompts, BeamSearchParams(args.beam_width, args.max_tokens))
            dt = time.perf_counter() - t0
        else:
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                    seed=args.seed, max_tokens=args.max_tokens)
            outputs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
    except (SpecError, WeightError, ValueError, RuntimeError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.beam_width:
        for prompt, out in zip(args.prompt, beams):
            print(f"### {prompt}")
            for i, seq in enumerate(out.sequences):
                print(f"[beam {i}, cum_logprob {seq.cum_logprob:.3f}] {seq.text}")
            print()
        print(f"[beam search in {dt:.2f}s]", file=sys.stderr)
        return 0
    n = 0
    for prompt, out in zip(args.prompt, outputs):
        c = out.outputs[0]
        n += len(c.token_ids)
        print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]\n")
    print(f"[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
