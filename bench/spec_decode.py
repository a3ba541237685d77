"""Speculative decoding on the real SmolLM2-135M: speculation off vs ngram, same invocation.

    python -m bench.spec_decode [--rounds 2] [--new-tokens 96] [--batches 1,32] [--k 4]
        [--workloads copy,free] [--threads 1] [--disable-by-batch-size N] [--draft-model SPEC]

With --draft-model the speculating engine drafts with that model (method 'draft'; both
engines then run with max_model_len 512); the columns still say "ngram".

Workloads (chat-templated text prompts, greedy, EOS ignored so every request makes exactly
`--new-tokens` tokens):
- copy: "rewrite / correct this passage" over a few ~150-token passages: the answer copies
  long runs of the prompt, which prompt lookup can draft;
- free: open-ended questions; the answer copies little.
Batch 1 runs the requests one after another; batch 32 sends 32 at once (prompts cycled).

Both engines (prefix caching off, so rounds do not time cache hits) are built first, run once
untimed, then timed alternately for `--rounds` rounds (order flipped each round). Printed per
workload and batch: output tokens/s and TPOT (median over requests of (finish - first token)
/ (tokens - 1)), median over rounds; the ngram/off ratios, paired: each round's ngram run over
the same round's off run, median over rounds (a noisy machine moves both runs of a round
together); acceptance rate and mean acceptance length of the ngram engine, the share of its
decode steps that verified drafts, and whether the greedy outputs are identical.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its "
    "keeper climbed the narrow stairs, trimmed the wick and watched the beam sweep across the dark water. "
    "Ships that passed the rocks below owed their safety to that steady light, and the villagers told "
    "stories of storms so fierce that the keeper stayed awake for three nights in a row.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide "
    "into sugar and oxygen. It takes place mostly in the leaves, inside small structures called "
    "chloroplasts, which contain the green pigment chlorophyll. The oxygen released is the air that "
    "animals breathe, and the sugar feeds the plant and everything that eats it.",
    "To make a simple loaf of bread, mix flour, water, salt and yeast into a dough. Knead it for ten "
    "minutes until it is smooth, then leave it covered in a warm place for an hour until it doubles in "
    "size. Shape the loaf, let it rise again for half an hour, and bake it in a hot oven for forty "
    "minutes until the crust is brown and it sounds hollow when tapped.",
]
QUESTIONS = ["Write a short story about a dragon who learns to cook.",
             "Explain why the sky is blue to a ten year old.",
             "What are some good habits for staying healthy?",
             "Describe your ideal holiday in a few sentences."]


def prompts(tok, workload: str) -> list[str]:
    if workload == "copy":
        texts = [f"Rewrite the following passage exactly, word for word, fixing nothing:\n\n{p}" for p in PASSAGES]
    else:
        texts = QUESTIONS
    return [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts]


def run(llm, texts: list[str], batch: int, new_tokens: int) -> dict:
    """Generate for `batch` requests at once (`texts` cycled); batch 1: len(texts) requests
    one after another. Returns tokens, seconds, per-request TPOTs and outputs."""
    from runtime import SamplingParams
    from runtime.sampling_params import RequestOutputKind
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.CUMULATIVE)
    waves = [[t] for t in texts] if batch == 1 else [[texts[i % len(texts)] for i in range(batch)]]
    tokens, tpots, outputs = 0, [], []
    start = time.perf_counter()
    for wave in waves:
        reqs = [engine.make_request(t, params) for t in wave]
        for r in reqs:
            engine.add_request(r)
        first, done = {}, {}
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, now)
                if o.finished:
                    done[o.request_id] = (now, o.outputs[0].token_ids)
        for r in reqs:
            t_end, ids = done[r.request_id]
            tokens += len(ids)
            outputs.append(ids)
            if len(ids) > 1:
                tpots.append((t_end - first[r.request_id]) / (len(ids) - 1))
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "tpot": statistics.median(tpots),
            "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--workloads", default="copy,free")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--draft-model", default=None,
                    help="speculate with this draft model (method 'draft') instead of ngram, e.g. "
                         "zoo/smollm2-135m.yaml (the target itself) or zoo/smollm2-tiny.yaml")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from models.embedded import ensure_embedded
    from runtime import LLM
    ensure_embedded("smollm2-135m")
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "disable_by_batch_size": args.disable_by_batch_size}
    common = dict(max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)
    if args.draft_model:     # a draft's context must cover the target's: 512 fits these workloads
        spec = {"method": "draft", "model": args.draft_model, "num_speculative_tokens": args.k,
                "disable_by_batch_size": args.disable_by_batch_size}
        common["max_model_len"] = 512
    engines = {"off": LLM("zoo/smollm2-135m.yaml", **common),
               "ngram": LLM("zoo/smollm2-135m.yaml", speculative=spec, **common)}
    tok = engines["off"].get_tokenizer()
    batches = [int(b) for b in args.batches.split(",")]
    cases = [(w, b) for w in args.workloads.split(",") for b in batches]
    for name, llm in engines.items():      # untimed warm-up of every case
        for w, b in cases:
            run(llm, prompts(tok, w)[:1], 1, 8)
    what = f"draft {args.draft_model}" if args.draft_model else "ngram"
    print(f"SmolLM2-135M fp32, {args.threads} thread(s), {args.new_tokens} new tokens, {what} k={args.k}, "
          f"{args.rounds} rounds (medians)")
    print(f"{'workload':8} {'batch':>5} | {'off tok/s':>9} {'ngram tok/s':>11} {'ratio':>6} | "
          f"{'off TPOT':>9} {'ngram TPOT':>10} {'ratio':>6} | {'accept':>6} {'len':>5} {'spec%':>5} same")
    for w, b in cases:
        texts = prompts(tok, w)
        res = {n: [] for n in engines}
        before = engines["ngram"].kv_cache_stats()
        counts = engines["ngram"].engine.spec_decoder.cost.decode.counts.copy()
        for rnd in range(args.rounds):
            order = list(engines) if rnd % 2 == 0 else list(reversed(engines))
            for n in order:
                res[n].append(run(engines[n], texts, b, args.new_tokens))
        steps = engines["ngram"].engine.spec_decoder.cost.decode.counts - counts   # regime 2 * bucket + drafting
        plain, drafting = steps[0::2].sum(), steps[1::2].sum()
        spec_share = drafting / max(1, plain + drafting)
        after = engines["ngram"].kv_cache_stats()
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        verifs = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        tps = {n: statistics.median(r["tokens"] / r["seconds"] for r in res[n]) for n in engines}
        tpot = {n: statistics.median(r["tpot"] for r in res[n]) for n in engines}
        tps_ratio = statistics.median((g["tokens"] / g["seconds"]) / (o["tokens"] / o["seconds"])
                                      for g, o in zip(res["ngram"], res["off"]))
        tpot_ratio = statistics.median(g["tpot"] / o["tpot"] for g, o in zip(res["ngram"], res["off"]))
        same = res["off"][0]["outputs"] == res["ngram"][0]["outputs"]
        print(f"{w:8} {b:5d} | {tps['off']:9.1f} {tps['ngram']:11.1f} {tps_ratio:6.2f} | "
              f"{tpot['off'] * 1e3:7.1f}ms {tpot['ngram'] * 1e3:8.1f}ms {tpot_ratio:6.2f} | "
              f"{accepted / max(1, drafted):6.2f} {1 + accepted / max(1, verifs):5.2f} {spec_share:5.0%} {same}")
        print(f"    cost model: {engines['ngram'].engine.spec_decoder.cost.describe(b)}")
    print(f"engine-wide acceptance (prior) {engines['ngram'].engine.spec_decoder.prior:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
