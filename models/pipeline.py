"""Pipeline parallelism: one stage's share of a causal LM (contiguous layers), and its sends.

Stage s of `pp` runs layers [s * L / pp, (s + 1) * L / pp): the first stage embeds, every
stage but the first receives the (hidden, residual) pair the previous stage sent, every
stage but the last sends its pair on, and only the last applies the final norm and the LM
head. The token count of a step is known to every stage (all hold the same persistent
batch), so the received buffers are sized without a message of their own. Sends do not wait:
a stage starts the next micro-batch while the next stage works on this one; every pending
send is waited on at the end of the step (`PPStageModel.drain`).

Every stage keeps the whole model's modules (the KV cache sizing and the state layers'
shapes read them), but the layers of other stages, and the embedding / head a stage does not
use, have their weights freed (`free_other_stages`) after packing.
"""
from __future__ import annotations

import torch

from models.builder import CausalLM
from models.parallel import TPGroup
from models.spec import ModelSpec


def stage_layers(spec: ModelSpec, pp: int) -> list[range]:
    """Each stage's layer range. Raises a one-line ValueError when pp does not divide the layers."""
    n = spec.num_layers
    if n % pp:
        raise ValueError(f"pipeline_parallel_size {pp}: layers.num is {n}; the pipeline-parallel size must divide it")
    per = n // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


class PPStageModel(CausalLM):
    """A CausalLM that runs one pipeline stage (`init_stage`)."""
    group: TPGroup
    layer_range: range

    def init_stage(self, group: TPGroup) -> "PPStageModel":
        self.group = group
        self.layer_range = stage_layers(self.spec, group.size)[group.rank]
        self.first, self.last = group.rank == 0, group.rank == group.size - 1
        self._sends: list = []
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """As CausalLM.forward for this stage's layers; a stage before the last returns its
        hidden states unnormed (nothing samples from them)."""
        t, hidden = input_ids.shape[0], self.spec.hidden_size
        dtype = self.norm.weight.dtype
        if self.first:
            x = self.embed_tokens(input_ids)
            if self.spec.embedding_multiplier != 1.0:
                x = x * self.spec.embedding_multiplier
            residual = None
        else:
            pair = self.group.recv(torch.empty(2, t, hidden, dtype=dtype, device=input_ids.device),
                                   self.group.rank - 1)
            x, residual = pair[0], pair[1]
        for i in self.layer_range:
            layer = self.layers[i]
            x, residual = layer(positions, x, residual, [kv_caches[c] for c in layer.cache_ids])
        if not self.last:
            self._sends.append(self.group.send(torch.stack((x, residual)), self.group.rank + 1))
            return x
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual, self.layers[-1].delta_multiplier)[0]

    def drain(self) -> None:
        """Wait for this step's sends (their buffers must live until they are out)."""
        for work in self._sends:
            work.wait()
        self._sends.clear()


@torch.no_grad()
def free_other_stages(model: PPStageModel) -> None:
    """Drop what this stage never runs: other stages' layers, the embedding unless first, the
    final norm and LM head unless last (their weights, and a packed linear's panels). A
    weight the stage does run stays, though a dropped module shares it (a tied embedding)."""
    dropped = [layer for i, layer in enumerate(model.layers) if i not in model.layer_range]
    if not model.first:
        dropped.append(model.embed_tokens)
    if not model.last:
        dropped += [model.norm, model.lm_head]
    kept = [model.layers[i] for i in model.layer_range] + ([model.embed_tokens] if model.first else []) + \
        ([model.norm, model.lm_head] if model.last else [])
    keep = {id(p) for m in kept for p in m.parameters()}
    for root in dropped:
        for module in root.modules():
            for p in module.parameters(recurse=False):
                if id(p) not in keep:
                    p.data = p.data.new_empty(0)
            if getattr(module, "packed", None) is not None:      # models/prepack.PackedLinear
                module.packed = module.packed.new_empty(0)
            if getattr(module, "screen", None) is not None:
                module.screen = None
