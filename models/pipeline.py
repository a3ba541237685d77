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
    """Drop the weights this stage never reads (other stages' layers; the embedding unless
    first or tied to a last stage's head; the head and final norm unless last)."""
    keep = {id(p) for i in model.layer_range for p in model.layers[i].parameters()}
    if model.first or (model.last and model.spec.tie_word_embeddings):
        keep.add(id(model.embed_tokens.weight))
    if model.last:
        keep.update(id(p) for p in model.lm_head.parameters())
        keep.update(id(p) for p in model.norm.parameters())
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in keep:
                p.data = p.data.new_empty(0)
        for attr in ("packed", "screen"):   # a packed linear's panels (models/prepack.py) of a dropped weight
            if getattr(module, "weight", None) is not None and module.weight.numel() == 0 and \
                    getattr(module, attr, None) is not None:
                setattr(module, attr, None if attr == "screen" else module.packed.new_empty(0))
