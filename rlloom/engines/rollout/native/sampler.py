"""Sampler: next tokens and their logprobs from a batch of logits rows, exact, in fp32.

Logprob contract with the trainer: the logprob of a sampled token is log_softmax(logits / T) in
fp32, the temperature-scaled distribution BEFORE top-k/top-p truncation (what
`rlloom.models.logprobs.token_logprobs(..., temperature=T)` computes). Greedy rows (T = 0) report
log_softmax(logits), the raw distribution's logprob.

Sampling is the exponential race (equivalently Gumbel-max): with E_v ~ Exponential(1) independent,
argmax_v p_v / E_v = argmax_v (log p_v - log E_v) is an exact draw from p. It costs one noise draw
and one argmax over the vocabulary, where torch.multinomial builds a CDF per row. top-k, then top-p
(on the renormalised top-k distribution), are applied by setting the dropped tokens to -inf first.

Noise: rows without a seed share one draw from the engine's generator. A row with a seed draws its
own noise from a generator seeded by (seed, sample index, token position), so its tokens do not
depend on the batch it runs in, on preemption or on prefix sharing.

Shape legend: R sampled rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def noise_key(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit generator seed mixing the three integers (splitmix64 finaliser)."""
    x = (
        seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB
    ) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(slots=True)
class SamplingRows:
    """Per-row sampling settings of one step (tensors on the logits' device)."""

    temperature_R: torch.Tensor
    """[R] float32; 0 = greedy."""
    top_p_R: torch.Tensor
    """[R] float32 in (0, 1]."""
    top_k_R: torch.Tensor
    """[R] int64; -1 = off."""
    noise_keys: list[int | None]
    """Per row: a `noise_key` for seeded rows, None to use the engine's generator."""

    @classmethod
    def build(
        cls,
        temperatures: list[float],
        top_ps: list[float],
        top_ks: list[int],
        noise_keys: list[int | None],
        device: torch.device,
    ) -> SamplingRows:
        return cls(
            temperature_R=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_p_R=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_k_R=torch.tensor(top_ks, dtype=torch.int64, device=device),
            noise_keys=noise_keys,
        )


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device).manual_seed(seed)
        self.row_generator = torch.Generator(device)

    @torch.no_grad()
    def __call__(self, logits_RV: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token_ids_R int64, logprobs_R float32)."""
        logits_RV = logits_RV.float()
        greedy_R = rows.temperature_R == 0
        temperature_R = torch.where(greedy_R, torch.ones_like(rows.temperature_R), rows.temperature_R)
        logp_RV = torch.log_softmax(logits_RV / temperature_R[:, None], dim=-1)
        if bool(greedy_R.all()):  # evaluation: no noise to draw
            token_ids_R = logits_RV.argmax(dim=-1)
            return token_ids_R, logp_RV.gather(1, token_ids_R[:, None]).squeeze(1)
        scores_RV = self._truncate(logp_RV, rows)
        log_noise_RV = self._log_noise(scores_RV, rows.noise_keys)
        sampled_R = (scores_RV - log_noise_RV).argmax(dim=-1)
        token_ids_R = torch.where(greedy_R, logits_RV.argmax(dim=-1), sampled_R)
        return token_ids_R, logp_RV.gather(1, token_ids_R[:, None]).squeeze(1)

    def _log_noise(self, like_RV: torch.Tensor, noise_keys: list[int | None]) -> torch.Tensor:
        """log E with E = -log U ~ Exponential(1), U ~ Uniform[0, 1); U = 0 gives +inf (never wins).
        (Drawn from uniforms: on CPU `exponential_` is about 5x slower than uniform_ + log_.)"""
        uniform_RV = torch.empty_like(like_RV)
        if any(key is None for key in noise_keys):
            uniform_RV.uniform_(generator=self.generator)
        for row, key in enumerate(noise_keys):
            if key is not None:
                self.row_generator.manual_seed(key)
                uniform_RV[row].uniform_(generator=self.row_generator)
        return uniform_RV.log_().neg_().log_()

    @staticmethod
    def _truncate(logp_RV: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """logp with the tokens dropped by top-k, then top-p, set to -inf (logp itself when neither is on)."""
        vocab = logp_RV.shape[-1]
        top_k_R = torch.where(rows.top_k_R > 0, rows.top_k_R.clamp(max=vocab), vocab)
        use_top_k = bool((top_k_R < vocab).any())
        use_top_p = bool((rows.top_p_R < 1).any())
        if not (use_top_k or use_top_p):
            return logp_RV
        scores_RV = logp_RV
        if use_top_k:
            top_RK = logp_RV.topk(int(top_k_R.max()), dim=-1).values
            threshold_R = top_RK.gather(1, (top_k_R.clamp(max=top_RK.shape[1]) - 1)[:, None])
            threshold_R = torch.where((top_k_R < vocab)[:, None], threshold_R, float("-inf"))
            scores_RV = scores_RV.masked_fill(scores_RV < threshold_R, float("-inf"))
        if use_top_p:
            sorted_RV, order_RV = scores_RV.sort(dim=-1, descending=True)
            probs_RV = sorted_RV.softmax(dim=-1)
            mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
            drop_sorted_RV = mass_before_RV >= rows.top_p_R[:, None]
            drop_RV = torch.zeros_like(drop_sorted_RV).scatter_(1, order_RV, drop_sorted_RV)
            scores_RV = scores_RV.masked_fill(drop_RV, float("-inf"))
        return scores_RV
