"""`ValueHead`: the critic of PPO as one module with `PolicyHead`'s `forward` (`StreamHead`), so the training
engine runs it unchanged (packing, shared prompts, micro-batches, FSDP, CP, checkpoints).

The value model is the causal LM's body with its vocabulary head replaced by a linear `score` head
[D] -> 1, as transformers' *ForTokenClassification with one label (verl's critic). It is read at the
positions where the policy reads a response token's logprob: the value of the state before each
response token, V(prompt, response[:t]). A new head starts at zero, so the first values are 0 and
the first update moves only the head; a value or reward model's checkpoint brings its own head.

Shape legend: N tokens in the packed stream, K selected positions, D hidden size.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from rlloom.engines.train.base import ForwardOptions
from rlloom.engines.train.native.policy import StreamHead


class ValueHead(StreamHead):
    """Wraps a CausalLM (`self.model`, its untied lm head dropped); `forward` returns values at K positions.

    `score`: a value or reward model's head to start from (`value_model_from_pretrained`: Hugging
    Face names `score.weight` [1, D] and maybe `score.bias` [1]); the rest of the head starts at zero."""

    def __init__(self, model: nn.Module, score: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        model.output = None  # no vocabulary head (a tied model keeps its embedding, which it still reads)
        self.model = model
        self.score = nn.Linear(model.args.hidden_size, 1, dtype=torch.float32)
        with torch.no_grad():
            for name, param in self.score.named_parameters():
                start = (score or {}).get(f"score.{name}")
                param.copy_(start) if start is not None else param.zero_()

    def head(
        self,
        hidden_ND: torch.Tensor,
        positions_K: torch.Tensor,
        targets_K: torch.Tensor,
        options: ForwardOptions,
    ) -> tuple[torch.Tensor, None]:
        """fp32 values [K] at `positions_K` and None (no entropy; `targets_K` and `options` are not
        used). Under tensor parallelism the hidden states come as token shards: every TP rank gathers
        the stream and runs the (replicated) head on all K positions, so each computes the same
        values and the same head gradients, and the gradient of its own token shard flows back."""
        if isinstance(hidden_ND, DTensor):  # tensor parallel: token shards
            hidden_ND = hidden_ND.redistribute(hidden_ND.device_mesh, [Replicate()]).to_local()
        num_selected = positions_K.shape[0]
        if num_selected == 0:  # as PolicyHead: run on one position, keep none (gradients reach every weight)
            positions_K = positions_K.new_zeros(1)
        values_K = self.score(hidden_ND[positions_K]).squeeze(-1).float()
        return values_K[:num_selected], None
