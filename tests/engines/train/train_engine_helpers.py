"""Shared pieces of the training-engine tests: a tiny random Qwen3 checkpoint, random batches and a
per-token policy loss that reads per-sample tensors of the global batch by index."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rlloom.algorithms.losses import aggregate_loss_sum
from rlloom.data.types import RolloutBatch, Sample

VOCAB = 64


def tiny_qwen3_config(**changes):
    """transformers' config of the tiny Qwen3 these tests use (3 layers, hidden 32)."""
    from transformers import Qwen3Config

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3)
    fields |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return Qwen3Config(**fields | changes)


def make_tiny_checkpoint(path: Path, *, tie: bool = False, seed: int = 0) -> str:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(tiny_qwen3_config(tie_word_embeddings=tie)).save_pretrained(path)
    return str(path)


def load_tiny(path: str) -> torch.nn.Module:
    from rlloom.models import from_pretrained

    return from_pretrained(path, dtype=torch.float32, device="cpu")


def make_batch(
    num_samples: int, *, seed: int = 0, max_prompt: int = 12, max_response: int = 20
) -> RolloutBatch:
    rng = random.Random(seed)
    samples = []
    for i in range(num_samples):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
        response = [rng.randrange(VOCAB) for _ in range(rng.randint(0 if i == 1 else 1, max_response))]
        mask = [int(rng.random() > 0.2) for _ in response]
        samples.append(Sample(prompt_ids=prompt, response_ids=response, loss_mask=mask, reward=rng.random()))
    return RolloutBatch(samples)


class PolicyLoss:
    """A REINFORCE-style loss with a per-sample advantage and a k2 term against fixed old logprobs."""

    def __init__(self, batch: RolloutBatch, mode: str, *, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.mask_BT = batch.response_mask()
        self.adv_B = torch.randn(len(batch), generator=gen)
        self.old_logp_BT = -torch.rand(len(batch), batch.T, generator=gen) * 4
        self.mode = mode

    def per_token(self, logp_BT: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        old = self.old_logp_BT[rows].to(logp_BT.device)
        adv = self.adv_B[rows].to(logp_BT.device)
        return -adv[:, None] * logp_BT + 0.5 * (logp_BT - old) ** 2

    def __call__(self, logp_bT: torch.Tensor, entropy_bT: torch.Tensor | None, rows: torch.Tensor):
        mask = self.mask_BT[rows].to(logp_bT.device)
        loss_bT = self.per_token(logp_bT, rows)
        if entropy_bT is not None:
            loss_bT = loss_bT - 0.01 * entropy_bT
        ratio = (logp_bT - self.old_logp_BT[rows].to(logp_bT.device)).exp()
        frac = ((ratio > 1.2) & mask).sum() / mask.sum().clamp(min=1)
        return aggregate_loss_sum(loss_bT, mask, self.mode), {"loss/ratio_high_frac": frac.detach()}
