"""llama-cpp-python runner: llama.cpp's batched low-level API with our own continuous batching.

The HF Llama checkpoint is written once as an F32 GGUF with the ``gguf`` package (no tokenizer
is needed for id-in / id-out generation, so the vocabulary is a placeholder SentencePiece list:
``<unk> <s> </s>``, the 256 byte tokens, then ``t<i>``). Q and K rows are permuted from HF's
rotate-half layout to the interleaved layout llama.cpp's Llama rope expects, as llama.cpp's own
converter does.

Scheduling mirrors the others' settings: at most ``max_num_seqs`` sequences in flight, each
``llama_decode`` call carries at most ``max_num_batched_tokens`` tokens, decode tokens first,
then prompt chunks (chunked prefill). The KV cache is F32 and unified (one pool for all
sequences). Option ``gguf``: load that file instead (a quantized GGUF as it ships, for the
same-file comparison of bench/quant_peers.py). The batch arrays are numpy-backed and filled by slices, and greedy picks one
argmax over all returned logit rows, so the Python side stays off the per-token path.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path


def _permute_rope(w, n_head: int):
    # HF rows per head: [first half of rotary dims..., second half...] -> interleaved pairs
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf_dir: str, target: Path) -> None:
    if target.exists():
        return
    import gguf
    import numpy as np
    from safetensors import safe_open
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"llamacpp runner: {hf_dir}: model_type {cfg.get('model_type')!r}; only llama is converted")
    h, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or h // n_head
    vocab = cfg["vocab_size"]
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise SystemExit(f"llamacpp runner: rope_type {rope.get('rope_type')!r} not handled")
    tmp = target.with_suffix(".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(len(tokens), vocab)]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (vocab - 259))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types[:vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight"}
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="np") as st:
            for name in st.keys():
                t = st.get_tensor(name).astype(np.float32)
                if name in names:
                    out = names[name]
                elif name.startswith("model.layers."):
                    _, _, idx, rest = name.split(".", 3)
                    if rest not in per_layer:
                        raise SystemExit(f"llamacpp runner: unexpected tensor {name}")
                    out = f"blk.{idx}.{per_layer[rest]}"
                    if rest == "self_attn.q_proj.weight":
                        t = _permute_rope(t, n_head)
                    elif rest == "self_attn.k_proj.weight":
                        t = _permute_rope(t, n_kv)
                else:
                    raise SystemExit(f"llamacpp runner: unexpected tensor {name}")
                w.add_tensor(out, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, target)


class Batch:
    """A llama_batch whose arrays are numpy buffers owned here (filled by slices, never freed by llama)."""

    def __init__(self, llama_cpp, cap: int):
        import numpy as np
        self.token = np.zeros(cap, np.int32)
        self.pos = np.zeros(cap, np.int32)
        self.n_seq_id = np.ones(cap, np.int32)
        self.seq = np.zeros(cap, np.int32)
        self.logits = np.zeros(cap, np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self.seq_ptrs = (i32p * cap)(*[ctypes.cast(base + 4 * i, i32p) for i in range(cap)])
        self.b = llama_cpp.llama_batch()
        self.b.token = self.token.ctypes.data_as(i32p)
        self.b.embd = None
        self.b.pos = self.pos.ctypes.data_as(i32p)
        self.b.n_seq_id = self.n_seq_id.ctypes.data_as(i32p)
        self.b.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(i32p))
        self.b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))


def load(wl: dict):
    import llama_cpp
    opts = wl.get("options", {})
    if opts.get("gguf"):     # a given GGUF as it ships (bench/quant_peers.py: the embedded Q4_1)
        path = Path(opts["gguf"])
    else:
        path = Path(opts["cache_dir"]) / "model-f32.gguf"
        write_gguf(wl["model_dir"], path)
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    # llama.cpp's extra CPU buffer types repack weights for its AMX / other ISA kernels; 0.3.36's AMX
    # repack segfaults at the first decode on a KVM AMX Xeon (bench/quant_peers.py --no-llamacpp-extra-bufts)
    mp.use_extra_bufts = bool(opts.get("extra_bufts", True))
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    longest = max(len(p) for p in wl["prompts"]) + wl["new_tokens"]
    seqs = int(wl["max_num_seqs"])
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = seqs * longest
    cp.n_batch = cp.n_ubatch = int(wl["max_num_batched_tokens"])
    cp.n_seq_max = seqs
    cp.n_threads = cp.n_threads_batch = int(wl["threads"])
    cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
    cp.kv_unified = True
    cp.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    return {"lib": llama_cpp, "model": model, "ctx": ctx, "n_vocab": n_vocab, "seqs": seqs,
            "budget": int(wl["max_num_batched_tokens"]), "batch": Batch(llama_cpp, int(wl["max_num_batched_tokens"]))}


def generate(e, prompts: list, new_tokens: int) -> list:
    import numpy as np
    lib, ctx, batch, budget = e["lib"], e["ctx"], e["batch"], e["budget"]
    mem = lib.llama_get_memory(ctx)
    lib.llama_memory_clear(mem, True)
    outputs: list[list[int]] = [[] for _ in prompts]
    waiting = list(range(len(prompts)))[::-1]         # pop() takes the next in input order
    slots: dict[int, int] = {}                         # request -> seq id
    free_seq = list(range(e["seqs"]))[::-1]
    done_prompt: dict[int, int] = {}                   # request -> prompt tokens already fed
    while waiting or slots:
        while waiting and free_seq:
            r = waiting.pop()
            slots[r] = free_seq.pop()
            done_prompt[r] = 0
        n = 0
        rows: list[int] = []                           # request per logits row, in batch order
        for r, s in slots.items():                     # decode tokens first
            if done_prompt[r] == len(prompts[r]) and outputs[r]:
                batch.token[n], batch.pos[n], batch.seq[n], batch.logits[n] = \
                    outputs[r][-1], len(prompts[r]) + len(outputs[r]) - 1, s, 1
                rows.append(r)
                n += 1
        for r, s in slots.items():                     # then prompt chunks in the remaining budget
            left = len(prompts[r]) - done_prompt[r]
            if left == 0 or n == budget:
                continue
            k = min(left, budget - n)
            start = done_prompt[r]
            batch.token[n:n + k] = prompts[r][start:start + k]
            batch.pos[n:n + k] = np.arange(start, start + k, dtype=np.int32)
            batch.seq[n:n + k] = s
            batch.logits[n:n + k] = 0
            done_prompt[r] += k
            if done_prompt[r] == len(prompts[r]):
                batch.logits[n + k - 1] = 1
                rows.append(r)
            n += k
        batch.b.n_tokens = n
        rc = lib.llama_decode(ctx, batch.b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if rows:
            # Logit rows come back in batch order of the tokens that asked for them, which is
            # the order `rows` was built in (decode tokens, then prompt-final tokens).
            logits = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(len(rows), e["n_vocab"]))
            for r, t in zip(rows, logits.argmax(axis=1).tolist()):
                outputs[r].append(t)
        for r in [r for r in slots if len(outputs[r]) == new_tokens]:
            lib.llama_memory_seq_rm(mem, slots[r], -1, -1)
            free_seq.append(slots.pop(r))
    return outputs


if __name__ == "__main__":
    import importlib.metadata
    from protocol import serve
    sys.exit(serve(load, generate, "llama-cpp-python " + importlib.metadata.version("llama-cpp-python")))
