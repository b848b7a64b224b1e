"""`ValueHead`: the critic of PPO as one module with `PolicyHead`'s call signature, so the training
engine runs it unchanged (packing, shared prompts, micro-batches, FSDP, CP, checkpoints).

The value model is the causal LM's body with its vocabulary head replaced by a linear `score` head
[D] -> 1, as transformers' *ForTokenClassification with one label (verl's critic). It is read at the
positions where the policy reads a response token's logprob: the value of the state before each
response token, V(prompt, response[:t]). The new head starts at zero, so the first values are 0 and
the first update moves only the head.

Shape legend: N tokens in the packed stream, K selected positions, D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from rlloom.engines.train.native.policy import stream_hidden_states
from rlloom.models.attention_ops import TreePlan
from rlloom.parallel.cp import CPShard


class ValueHead(nn.Module):
    """Wraps a CausalLM (`self.model`, its untied lm head dropped); `forward` returns values at K positions."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        model.output = None  # no vocabulary head (a tied model keeps its embedding, which it still reads)
        self.model = model
        self.score = nn.Linear(model.args.hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(
        self,
        input_ids_N: torch.Tensor,
        position_ids_N: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        positions_K: torch.Tensor,
        targets_K: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        tree: TreePlan | None = None,
        routes_NLK: torch.Tensor | None = None,
        replay_routes: bool = False,
        cp: CPShard | None = None,
    ) -> tuple[torch.Tensor, None]:
        """fp32 values [K] at `positions_K` and None (no entropy); arguments as `PolicyHead.forward`'s
        (`targets_K`, `temperature` and `with_entropy` are not used). No tensor parallelism: the
        engine refuses a value head under it."""
        hidden_ND = stream_hidden_states(
            self.model,
            input_ids_N,
            position_ids_N,
            cu_seqlens,
            max_seqlen,
            tree,
            routes_NLK,
            replay_routes,
            cp,
        )
        num_selected = positions_K.shape[0]
        if num_selected == 0:  # as PolicyHead: run on one position, keep none (gradients reach every weight)
            positions_K = positions_K.new_zeros(1)
        values_K = self.score(hidden_ND[positions_K]).squeeze(-1).float()
        return values_K[:num_selected], None
