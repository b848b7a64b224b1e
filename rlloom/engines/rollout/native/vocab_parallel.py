"""VocabParallelSampler: the sampler of a tensor-parallel engine, whose rank holds only the logits
columns of its vocabulary slice [start, start + Vp) (tensor_parallel.py pads the vocabulary to tp * Vp).

It returns what `Sampler` returns on the full logits, on every rank (vLLM's vocab-parallel sampler
and logprobs work the same way):
- one all-gather per step: each rank sends, per row, the max of z = logits / T over its columns, its
  sum of exp(z - max), its best score (logits for greedy rows, z - log E for sampled rows, as in
  sampler.py), that column's vocabulary id and z there ([R, 5] float64).
- logprob = z_token - logsumexp(z), the log-sum-exp combined from the ranks' (max, sum) pairs, so the
  normaliser covers the full vocabulary.
- token = the global argmax of the score: the highest best score wins and a tie goes to the lower
  rank, i.e. the lower id, which is how `argmax` over the full row resolves it.
- noise: `Sampler._log_noise` draws the noise of the FULL vocabulary row (the same draw as tp = 1:
  the same key per seeded row, the same generator state for unseeded ones, the engine seed being
  the same on every rank) and each rank keeps its columns, so seeded and unseeded samples are the
  tokens tp = 1 draws. It costs every rank the noise of the whole row ([R, V] floats per step, as
  at tp = 1); the logits and the softmax work are split.
- top-k / top-p rows need the global order of the candidates: a step with such a row all-gathers
  the logits ([R, V]) and runs `Sampler` on them unchanged. RL runs leave both off (the split path).
  So does every step under exact numerics (`rollout.match_training`): the logprob is then tp = 1's
  log-softmax of the full row, which tensor-parallel training computes the same way
  (rlloom/parallel/vocab_parallel.py), where the combined (max, sum) pairs round otherwise.

Shape legend: R sampled rows, V vocabulary, Vp logits columns of one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlloom.devices import to_device
from rlloom.engines.rollout.native.sampler import Sampler, SamplingRows
from rlloom.engines.rollout.native.tensor_parallel import TPShards
from rlloom.models.exact import is_exact


class VocabParallelSampler(Sampler):
    def __init__(self, device: torch.device, seed: int, shards: TPShards) -> None:
        super().__init__(device, seed)
        self.shards = shards

    @torch.no_grad()
    def __call__(self, logits_RVp: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's logits columns -> (token_ids_R int64, logprobs_R float32), the same on every rank."""
        if rows.truncate or is_exact():
            return super().__call__(self._gather_vocab(logits_RVp), rows)
        keys_R = None
        if self.use_triton and logits_RVp.is_cuda:  # the keys tp = 1 draws, in the same order
            keys = [self.host_rng.getrandbits(63) if k is None else k for k in rows.noise_keys]
            keys_R = to_device(torch.tensor(keys, dtype=torch.int64), logits_RVp.device)
        s = self.shards
        logits_RVp = logits_RVp.float()
        padding = torch.arange(logits_RVp.shape[1], device=logits_RVp.device) >= s.vocab_valid
        logits_RVp = logits_RVp.masked_fill(padding, float("-inf"))
        greedy_R = rows.temperature_R == 0
        temperature_R = torch.where(greedy_R, torch.ones_like(rows.temperature_R), rows.temperature_R)
        z_RVp = logits_RVp / temperature_R[:, None]
        if rows.all_greedy:
            scores_RVp = logits_RVp
        else:
            R, V = logits_RVp.shape[0], s.full_args.vocab_size
            full_noise_RV = self._log_noise(logits_RVp.new_empty(R, V), rows.noise_keys, keys_R)
            log_noise_RVp = torch.zeros_like(logits_RVp)
            log_noise_RVp[:, : s.vocab_valid] = full_noise_RV[
                :, s.vocab_start : s.vocab_start + s.vocab_valid
            ]
            scores_RVp = torch.where(greedy_R[:, None], logits_RVp, z_RVp - log_noise_RVp)
        ranks_PR5 = self._gather_stats(_local_stats(z_RVp, scores_RVp, s.vocab_start))
        max_PR, sum_PR = ranks_PR5[..., 0], ranks_PR5[..., 1]
        max_R = max_PR.max(dim=0).values
        lse_R = max_R + (sum_PR * (max_PR - max_R).exp()).sum(dim=0).log()
        winner_R = ranks_PR5[..., 2].argmax(dim=0)  # the first rank holding the best score
        won_R5 = ranks_PR5.gather(0, winner_R[None, :, None].expand(1, -1, 5))[0]
        return won_R5[:, 3].long(), (won_R5[:, 4] - lse_R).float()

    def _gather_stats(self, mine_R5: torch.Tensor) -> torch.Tensor:
        """[tp, R, 5]: every rank's `_local_stats` (the step's one collective)."""
        gathered = [torch.empty_like(mine_R5) for _ in range(self.shards.size)]
        dist.all_gather(gathered, mine_R5, group=self.shards.group)
        return torch.stack(gathered)

    def _gather_vocab(self, logits_RVp: torch.Tensor) -> torch.Tensor:
        """[R, V]: every rank's columns side by side, padding dropped."""
        s = self.shards
        parts = [torch.empty_like(logits_RVp) for _ in range(s.size)]
        dist.all_gather(parts, logits_RVp.contiguous(), group=s.group)
        return torch.cat(parts, dim=-1)[:, : s.full_args.vocab_size]


def _local_stats(z_RVp: torch.Tensor, scores_RVp: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """[R, 5] float64 per row of this rank's columns: max of z, sum of exp(z - max) (0 for a rank with
    no real column), the best score, its vocabulary id (the first one on ties) and z there."""
    max_R = z_RVp.max(dim=-1).values
    max_R = torch.where(max_R.isfinite(), max_R, 0.0)
    sum_R = (z_RVp - max_R[:, None]).exp().sum(dim=-1)
    best_R = scores_RVp.argmax(dim=-1)
    at_best = best_R[:, None]
    stats = [
        max_R,
        sum_R,
        scores_RVp.gather(1, at_best)[:, 0],
        best_R + vocab_start,
        z_RVp.gather(1, at_best)[:, 0],
    ]
    return torch.stack([x.double() for x in stats], dim=-1)
