"""VocabParallelSampler: the sampler of a tensor-parallel engine, whose rank holds only the logits
columns of its vocabulary slice [start, start + Vp) (tensor_parallel.py pads the vocabulary to tp * Vp).

It returns what `Sampler` returns on the full logits, on every rank (vLLM's vocab-parallel sampler
and logprobs work the same way):
- logprob = z_token - logsumexp(z) with z = logits / T: each rank's max is all-reduced (MAX), then
  its sum of exp(z - max) (SUM), so the normaliser covers the full vocabulary.
- token = the global argmax of the score (logits for greedy rows, z - log E for sampled rows, as in
  sampler.py). Each rank sends (best score, its vocabulary id, z at that id) for each row, one
  all-gather of [R, 3]; the highest score wins and a tie goes to the lower rank, i.e. the lower id,
  which is how `argmax` over the full row resolves it.
- noise: `Sampler._log_noise` draws the noise of the FULL vocabulary row (the same draw as tp = 1:
  the same key per seeded row, the same generator state for unseeded ones, the engine seed being
  the same on every rank) and each rank keeps its columns, so seeded and unseeded samples are the
  tokens tp = 1 draws. It costs every rank the noise of the whole row ([R, V] floats per step, as
  at tp = 1); the logits and the softmax work are split.
- top-k / top-p rows need the global order of the candidates: a step with such a row all-gathers
  the logits ([R, V]) and runs `Sampler` on them unchanged. RL runs leave both off (the split path).

Shape legend: R sampled rows, V vocabulary, Vp logits columns of one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlloom.devices import to_device
from rlloom.engines.rollout.native.sampler import Sampler, SamplingRows
from rlloom.engines.rollout.native.tensor_parallel import TPShards


class VocabParallelSampler(Sampler):
    def __init__(self, device: torch.device, seed: int, shards: TPShards) -> None:
        super().__init__(device, seed)
        self.shards = shards

    @torch.no_grad()
    def __call__(self, logits_RVp: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's logits columns -> (token_ids_R int64, logprobs_R float32), the same on every rank."""
        if rows.truncate:
            return super().__call__(self._gather_vocab(logits_RVp), rows)
        keys_R = None
        if self.use_triton and logits_RVp.is_cuda:  # the keys tp = 1 draws, in the same order
            keys = [self.host_rng.getrandbits(63) if k is None else k for k in rows.noise_keys]
            keys_R = to_device(torch.tensor(keys, dtype=torch.int64), logits_RVp.device)
        s, group = self.shards, self.shards.group
        logits_RVp = logits_RVp.float()
        padding = torch.arange(logits_RVp.shape[1], device=logits_RVp.device) >= s.vocab_valid
        logits_RVp = logits_RVp.masked_fill(padding, float("-inf"))
        greedy_R = rows.temperature_R == 0
        temperature_R = torch.where(greedy_R, torch.ones_like(rows.temperature_R), rows.temperature_R)
        z_RVp = logits_RVp / temperature_R[:, None]
        max_R = z_RVp.max(dim=-1).values
        dist.all_reduce(max_R, op=dist.ReduceOp.MAX, group=group)
        sum_R = (z_RVp - max_R[:, None]).exp().sum(dim=-1)
        dist.all_reduce(sum_R, group=group)
        lse_R = max_R + sum_R.log()
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
        best_R = scores_RVp.argmax(dim=-1)
        mine_R3 = torch.stack(
            [
                scores_RVp.gather(1, best_R[:, None])[:, 0],
                best_R + s.vocab_start,
                z_RVp.gather(1, best_R[:, None])[:, 0],
            ],
            dim=-1,
        ).double()
        gathered = [torch.empty_like(mine_R3) for _ in range(s.size)]
        dist.all_gather(gathered, mine_R3, group=group)
        ranks_PR3 = torch.stack(gathered)
        winner_R = ranks_PR3[:, :, 0].argmax(dim=0)  # the first rank holding the best score
        won_R3 = ranks_PR3.gather(0, winner_R[None, :, None].expand(1, -1, 3))[0]
        token_ids_R = won_R3[:, 1].long()
        return token_ids_R, (won_R3[:, 2].float() - lse_R)

    def _gather_vocab(self, logits_RVp: torch.Tensor) -> torch.Tensor:
        """[R, V]: every rank's columns side by side, padding dropped."""
        s = self.shards
        parts = [torch.empty_like(logits_RVp) for _ in range(s.size)]
        dist.all_gather(parts, logits_RVp.contiguous(), group=s.group)
        return torch.cat(parts, dim=-1)[:, : s.full_args.vocab_size]
