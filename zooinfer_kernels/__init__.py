"""Compute kernels with their Python wrappers, one home for all of them.

- `cpu/`: the C++ sources of the CPU kernel library (one JIT-built library, op namespace
  `zooinfer_cpu`); `cpu_build` builds and loads it (`available()`).
- `paged_attention`: paged decode / prefill attention and the paged K/V write, used by the
  torch attention backend (attention/torch_backend.py).
- `gemm`: the panel layout of linear weights and the panel GEMM (models/prepack.py packs).
- `lm_head`: greedy tokens of an LM head (`GreedyHead`: the fused LM head + argmax kernels,
  the fast argmax over logits).
- `elementwise`: fused RMSNorm, residual add + RMSNorm, act(gate) * up, rotary.
- `quant_gemm`: linears on quantized weights; `quant_head`: greedy tokens of a quantized LM head.

A leaf package: it imports nothing from runtime, models, attention or cache, and everyone
may import it.
"""
