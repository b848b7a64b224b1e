"""`PolicyHead`: the causal LM and its chunked logprob head as one module with one `forward`.

FSDP hooks run around a module's `forward`, so the head's weight (the lm head or the tied embedding,
owned by the root FSDP unit) must be used inside the root's forward. Wrapping hidden states and
`token_logprobs` in one forward does that, and lets the head run only at the positions that predict
a trained response token instead of over the whole packed stream.

Shape legend: N tokens in the packed stream, S segments, Z branches of shared-prompt segments,
K selected positions, D hidden size, b samples of a micro-batch, T response tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from rlloom.data.types import RolloutBatch
from rlloom.devices import to_device
from rlloom.models.attention_ops import TreePlan
from rlloom.models.logprobs import token_logprobs


class PolicyHead(nn.Module):
    """Wraps a CausalLM (`self.model`); `forward` returns logprobs (and entropies) at K positions."""

    def __init__(self, model: nn.Module, *, chunk_tokens: int, fused_head: bool = False) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.fused_head = fused_head
        """Run the head's elementwise passes as Triton kernels (CUDA; see models/logprobs.py)."""

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 log p(targets_K[k] | what position positions_K[k] attends to) [K], and entropy [K] or None.

        input_ids_N, position_ids_N: [N]; cu_seqlens: [S + 1] int32; positions_K, targets_K: [K] int64
        (positions may repeat: a shared prompt's last position predicts the first token of each
        branch); tree: the shared-prompt layout built on the host (a `TreePlan`: FSDP leaves it
        alone, where it would copy tensors to the GPU), or None for plain packed sequences;
        routes_NLK: the rollout's experts per position for MoE models (compared, or with
        replay_routes replayed: see rlloom/models/moe.py).
        """
        hidden_ND = self.model.hidden_states(
            input_ids_N,
            position_ids=position_ids_N,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            tree=tree,
            routes_NLK=routes_NLK,
            replay_routes=replay_routes,
        )
        num_selected = positions_K.shape[0]
        if num_selected == 0:
            # Run the head on one position and keep none of it: the result is still connected to
            # every parameter, so backward gives (zero) gradients everywhere, as on other ranks.
            positions_K = positions_K.new_zeros(1)
            targets_K = targets_K.new_zeros(1)
        logp_K, entropy_K = token_logprobs(
            hidden_ND[positions_K],
            self.model.lm_head_weight,
            targets_K,
            temperature=temperature,
            chunk_tokens=self.chunk_tokens,
            with_entropy=with_entropy,
            fused=self.fused_head,
        )
        if num_selected == 0:
            logp_K = logp_K[:0]
            entropy_K = entropy_K[:0] if entropy_K is not None else None
        return logp_K, entropy_K


def run_micro_batch(
    module: nn.Module,
    batch: RolloutBatch,
    device: torch.device,
    temperature: float,
    with_entropy: bool,
    *,
    share_prompts: bool = False,
    replay_routes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """Pack `batch` (one micro-batch; shared-prompt layout with `share_prompts`), run `module` (a
    PolicyHead, maybe FSDP-wrapped) on it; with `replay_routes` an MoE model uses the experts the
    rollout recorded in the samples (routing replay).

    Returns logp_bT and entropy_bT (or None) on `device`, fp32 [b, T] and 0 where the response mask
    is false, then the number of tokens in the packed stream and the number of response tokens.
    Differentiable when grad is enabled. Everything the host must read (the segment structure, the
    selected positions, the counts) is computed on CPU and only the model's inputs are copied, so on
    CUDA the call queues its kernels without waiting for the GPU.
    """
    packed = batch.packed(share_prompts=share_prompts)
    mask_bT = packed.response_mask_BT
    flat_K = mask_bT.flatten().nonzero().squeeze(1)
    if replay_routes and packed.routes_NLK is None:
        raise ValueError(
            "algorithm.routing_replay=rollout needs the experts the rollout chose, but a sample has no "
            "routed_experts (a dense model, or samples not made by the rollout engine). Fix: set "
            "algorithm.routing_replay=none for this model."
        )
    tree = None
    if packed.prefix_lens_S is not None and packed.branch_lens_Z is not None:
        tree = TreePlan(packed.cu_seqlens, packed.prefix_lens_S, packed.branch_lens_Z, device)
    logp_K, entropy_K = module(
        to_device(packed.input_ids_N, device),
        to_device(packed.position_ids_N, device),
        to_device(packed.cu_seqlens, device),
        packed.max_seqlen,
        to_device(packed.gather_index_BT[mask_bT], device),
        to_device(packed.target_ids_BT[mask_bT], device),
        temperature,
        with_entropy,
        tree,
        None if packed.routes_NLK is None else to_device(packed.routes_NLK, device),
        replay_routes,
    )
    flat_K_device = to_device(flat_K, device)

    def spread(values_K: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(mask_bT.numel(), dtype=torch.float32, device=device)
        return zeros.index_put((flat_K_device,), values_K).view(mask_bT.shape)

    entropy_bT = spread(entropy_K) if entropy_K is not None else None
    return spread(logp_K), entropy_bT, packed.input_ids_N.numel(), flat_K.numel()
