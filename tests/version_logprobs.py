"""The check the asynchronous-mode tests share: a response token's behaviour logprob is the forward
of the policy version that produced it (tests/trainer/test_async_loop.py, single turns;
tests/episodes/test_episodes_async.py, multi-turn episodes whose turns may span two versions)."""

from __future__ import annotations

import torch

from rlloom.data.types import Sample


def logprobs_under(
    reference: torch.nn.Module, weights: dict[str, torch.Tensor], sample: Sample
) -> torch.Tensor:
    """Each response token's logprob in `sample` under `weights` (a policy version's Hugging Face
    state dict), by `reference`: a Hugging Face model of the same architecture, whose weights this
    replaces."""
    reference.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = reference(torch.tensor([sample.token_ids])).logits[0].float()
    prompt = len(sample.prompt_ids)
    return torch.log_softmax(logits[prompt - 1 : -1], -1).gather(
        1, torch.tensor(sample.response_ids)[:, None]
    )[:, 0]
