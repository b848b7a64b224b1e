"""Sampler: next tokens and their logprobs from a batch of logits rows, exact, in fp32.

Logprob contract with the trainer: the logprob of a sampled token is log_softmax(logits / T) in
fp32, the temperature-scaled distribution BEFORE top-k/top-p truncation (what
`rlloom.models.logprobs.token_logprobs(..., temperature=T)` computes). Greedy rows (T = 0) report
log_softmax(logits), the raw distribution's logprob.

Sampling is the exponential race (equivalently Gumbel-max): with E_v ~ Exponential(1) independent,
argmax_v p_v / E_v = argmax_v (logits_v / T - log E_v) is an exact draw from p. It costs one noise
draw and one argmax over the vocabulary, where torch.multinomial builds a CDF per row. top-k, then
top-p (on the renormalised top-k distribution), are applied by setting the dropped tokens to -inf.

Noise: every row has a 63-bit noise key. A row with a seed uses `noise_key(seed, sample index,
token position)`, so its tokens do not depend on the batch it runs in, on preemption or on prefix
sharing; the other rows draw a fresh key per step from the engine's seeded host generator. On CUDA
the uniforms come from Triton's Philox (vocabulary index 4c + i takes output i of Philox(key, c)),
and rows without top-k/top-p (the RL case) go through fused kernels that read the model-dtype
logits once: each (row, vocabulary chunk) computes its softmax statistics, noise and best score in
one pass, and a small kernel per row combines the chunks into the token and its logprob; with
top-k/top-p, and under rollout.match_training (whose logprob must be the training head's
log-softmax, models/exact.py), the torch path below runs on the same noise. On CPU the uniforms come
from a torch generator seeded with the key.

Shape legend: R sampled rows, V vocabulary.
"""

# Triton reads a kernel's annotations as specialisation hints, so its pointer arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from rlloom.devices import to_device
from rlloom.models.exact import is_exact

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path with torch generators is used
    triton = None

_MASK64 = (1 << 64) - 1


def noise_key(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit generator seed mixing the three integers (splitmix64 finaliser)."""
    x = (
        seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB
    ) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return (x ^ (x >> 31)) >> 1


if triton is not None:

    @triton.jit
    def _log_exponential(key, first, QUADS: tl.constexpr):
        """log E for the 4 * QUADS vocabulary indices from `first` (a multiple of 4) as a [QUADS, 4]
        tile (row-major, so tile[c, i] is index first + 4c + i). E = -log U where index 4c + i takes
        output i of Philox(key, c): one Philox evaluation serves four indices (it dominated the
        sampler's time when every index ran its own). U = 0 gives E = +inf (never wins)."""
        r0, r1, r2, r3 = tl.randint4x(key, first // 4 + tl.arange(0, QUADS))
        lane = tl.arange(0, 4)[None, :]
        bits = tl.where(
            lane == 0,
            r0[:, None],
            tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])),
        )
        return tl.log(-tl.log(tl.uint_to_uniform_float(bits)))

    @triton.jit
    def _tile_offsets(QUADS: tl.constexpr):
        """[QUADS, 4] offsets 0 .. 4 * QUADS - 1 in row-major order (the layout of `_log_exponential`)."""
        return 4 * tl.arange(0, QUADS)[:, None] + tl.arange(0, 4)[None, :]

    @triton.jit
    def _log_noise_kernel(keys_ptr, out_ptr, V, QUADS: tl.constexpr):
        r = tl.program_id(0)
        first = tl.program_id(1) * 4 * QUADS
        offs = first + _tile_offsets(QUADS)
        key = tl.load(keys_ptr + r)
        tl.store(out_ptr + r.to(tl.int64) * V + offs, _log_exponential(key, first, QUADS), mask=offs < V)

    @triton.jit
    def _sample_chunk_kernel(
        logits_ptr, stride_r, temperature_ptr, keys_ptr, part_ptr, V, NUM_CHUNKS,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One (row, vocabulary chunk): online log-sum-exp of logits / T over the chunk, and its
        best score logits / T - log E (the logits when T = 0) with its first index. Stores
        (max, sum, best score, best index) at part[row, chunk]."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        row_ptr = logits_ptr + r.to(tl.int64) * stride_r
        temperature = tl.load(temperature_ptr + r)
        greedy = temperature == 0.0
        temperature = tl.where(greedy, 1.0, temperature)
        key = tl.load(keys_ptr + r)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        best, best_idx = m, tl.argmax(tl.zeros([BLOCK], tl.float32), axis=0) + c * CHUNK
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            offs = start + _tile_offsets(BLOCK // 4)
            valid = offs < V
            x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
            if temperature == 1.0:  # x / 1 is x: skip the division (the RL case)
                z = x
            else:
                z = tl.math.div_rn(x, temperature)  # IEEE division, as torch's logits / T
            m_new = tl.maximum(m, tl.max(tl.max(z, axis=1), axis=0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.sum(tl.exp(z - m_new), axis=1), axis=0)
            m = m_new
            score = tl.where(greedy, z, z - _log_exponential(key, start, BLOCK // 4))
            score = tl.where(valid, score, float("-inf"))
            chunk_best = tl.max(tl.max(score, axis=1), axis=0)
            # The first index holding the maximum, as torch.argmax.
            chunk_idx = tl.min(tl.min(tl.where(score == chunk_best, offs, V), axis=1), axis=0)
            better = chunk_best > best  # strict: an earlier block keeps a tie
            best_idx = tl.where(better, chunk_idx, best_idx)
            best = tl.where(better, chunk_best, best)
        out = part_ptr + (r * NUM_CHUNKS + c) * 4
        tl.store(out, m)
        tl.store(out + 1, total)
        tl.store(out + 2, best)
        tl.store(out + 3, best_idx.to(tl.float32))  # exact: vocabulary indices < 2**24

    @triton.jit
    def _sample_combine_kernel(
        logits_ptr, stride_r, temperature_ptr, part_ptr, token_ptr, logprob_ptr, NUM_CHUNKS,
        CHUNKS_POW2: tl.constexpr,
    ):  # fmt: skip
        """One row: the chunks' (max, sum) into the row's log-sum-exp, the first chunk holding the
        best score gives the token, and its log_softmax(logits / T)."""
        r = tl.program_id(0)
        c = tl.arange(0, CHUNKS_POW2)
        in_row = c < NUM_CHUNKS
        part = part_ptr + (r * NUM_CHUNKS + c) * 4
        m_c = tl.load(part, mask=in_row, other=float("-inf"))
        total_c = tl.load(part + 1, mask=in_row, other=0.0)
        best_c = tl.load(part + 2, mask=in_row, other=float("-inf"))
        idx_c = tl.load(part + 3, mask=in_row, other=0.0)
        m = tl.max(m_c, axis=0)
        total = tl.sum(tl.where(in_row, total_c * tl.exp(m_c - m), 0.0), axis=0)
        winner = tl.argmax(best_c, axis=0)  # the first chunk with the best score
        token = tl.sum(tl.where(c == winner, idx_c, 0.0), axis=0).to(tl.int64)
        temperature = tl.load(temperature_ptr + r)
        temperature = tl.where(temperature == 0.0, 1.0, temperature)
        z_token = tl.math.div_rn(
            tl.load(logits_ptr + r.to(tl.int64) * stride_r + token).to(tl.float32), temperature
        )
        tl.store(token_ptr + r, token)
        tl.store(logprob_ptr + r, z_token - m - tl.log(total))


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
    all_greedy: bool = False
    """Every row has T = 0 (known on the host, so no device sync decides the path)."""
    truncate: bool = True
    """Some row uses top-k or top-p."""

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
            temperature_R=to_device(torch.tensor(temperatures, dtype=torch.float32), device),
            top_p_R=to_device(torch.tensor(top_ps, dtype=torch.float32), device),
            top_k_R=to_device(torch.tensor(top_ks, dtype=torch.int64), device),
            noise_keys=noise_keys,
            all_greedy=all(t == 0 for t in temperatures),
            truncate=any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps),
        )


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.use_triton = triton is not None and torch.device(device).type == "cuda"
        self.generator = torch.Generator(device).manual_seed(seed)
        self.row_generator = torch.Generator(device)
        self.host_rng = random.Random(seed)

    @torch.no_grad()
    def __call__(self, logits_RV: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token_ids_R int64, logprobs_R float32); logits in any float dtype."""
        keys_R = None
        if self.use_triton and logits_RV.is_cuda:
            keys = [self.host_rng.getrandbits(63) if k is None else k for k in rows.noise_keys]
            keys_R = to_device(torch.tensor(keys, dtype=torch.int64), logits_RV.device)
            if not rows.truncate and not is_exact():
                return self._fused(logits_RV, rows.temperature_R, keys_R)
        logits_RV = logits_RV.float()
        greedy_R = rows.temperature_R == 0
        temperature_R = torch.where(greedy_R, torch.ones_like(rows.temperature_R), rows.temperature_R)
        z_RV = logits_RV / temperature_R[:, None]
        logp_RV = torch.log_softmax(z_RV, dim=-1)
        if rows.all_greedy:  # evaluation: no noise to draw
            token_ids_R = logits_RV.argmax(dim=-1)
            return token_ids_R, logp_RV.gather(1, token_ids_R[:, None]).squeeze(1)
        scores_RV = self._truncate(z_RV, logp_RV, rows)
        log_noise_RV = self._log_noise(scores_RV, rows.noise_keys, keys_R)
        sampled_R = (scores_RV - log_noise_RV).argmax(dim=-1)
        token_ids_R = torch.where(greedy_R, logits_RV.argmax(dim=-1), sampled_R)
        return token_ids_R, logp_RV.gather(1, token_ids_R[:, None]).squeeze(1)

    @staticmethod
    def _fused(
        logits_RV: torch.Tensor, temperature_R: torch.Tensor, keys_R: torch.Tensor, chunk: int = 8192
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two kernels: every (row, vocabulary chunk) in parallel, then one combine per row (one
        program per row over a 152k vocabulary reads the logits at a tenth of the bandwidth)."""
        R, V = logits_RV.shape
        num_chunks = triton.cdiv(V, chunk)
        part = torch.empty(R, num_chunks, 4, dtype=torch.float32, device=logits_RV.device)
        token_ids_R = torch.empty(R, dtype=torch.int64, device=logits_RV.device)
        logprobs_R = torch.empty(R, dtype=torch.float32, device=logits_RV.device)
        _sample_chunk_kernel[(R, num_chunks)](
            logits_RV, logits_RV.stride(0), temperature_R, keys_R, part, V, num_chunks,
            CHUNK=chunk, BLOCK=min(chunk, 2048), num_warps=4,
        )  # fmt: skip
        _sample_combine_kernel[(R,)](
            logits_RV, logits_RV.stride(0), temperature_R, part, token_ids_R, logprobs_R, num_chunks,
            CHUNKS_POW2=max(2, triton.next_power_of_2(num_chunks)), num_warps=1,
        )  # fmt: skip
        return token_ids_R, logprobs_R

    def _log_noise(
        self, like_RV: torch.Tensor, noise_keys: list[int | None], keys_R: torch.Tensor | None
    ) -> torch.Tensor:
        """log E with E = -log U ~ Exponential(1), U ~ Uniform[0, 1); U = 0 gives +inf (never wins).
        (Drawn from uniforms: on CPU `exponential_` is about 5x slower than uniform_ + log_.)"""
        if keys_R is not None:  # CUDA: the fused kernel's noise, so a seeded row gets the same draw
            R, V = like_RV.shape
            out_RV = torch.empty(R, V, dtype=torch.float32, device=like_RV.device)
            _log_noise_kernel[(R, triton.cdiv(V, 4096))](keys_R, out_RV, V, QUADS=1024)
            return out_RV
        uniform_RV = torch.empty_like(like_RV)
        if any(key is None for key in noise_keys):
            uniform_RV.uniform_(generator=self.generator)
        for row, key in enumerate(noise_keys):
            if key is not None:
                self.row_generator.manual_seed(key)
                uniform_RV[row].uniform_(generator=self.row_generator)
        return uniform_RV.log_().neg_().log_()

    @staticmethod
    def _truncate(z_RV: torch.Tensor, logp_RV: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """logits / T with the tokens dropped by top-k, then top-p, set to -inf (z itself when
        neither is on). The scores are z rather than logp so that a row's draw matches the fused path."""
        if not rows.truncate:
            return z_RV
        vocab = logp_RV.shape[-1]
        top_k_R = torch.where(rows.top_k_R > 0, rows.top_k_R.clamp(max=vocab), vocab)
        drop_RV = torch.zeros_like(logp_RV, dtype=torch.bool)
        scores_RV = logp_RV
        if bool((top_k_R < vocab).any()):
            top_RK = logp_RV.topk(int(top_k_R.max()), dim=-1).values
            threshold_R = top_RK.gather(1, (top_k_R.clamp(max=top_RK.shape[1]) - 1)[:, None])
            threshold_R = torch.where((top_k_R < vocab)[:, None], threshold_R, float("-inf"))
            drop_RV |= scores_RV < threshold_R
            scores_RV = scores_RV.masked_fill(drop_RV, float("-inf"))
        if bool((rows.top_p_R < 1).any()):
            sorted_RV, order_RV = scores_RV.sort(dim=-1, descending=True)
            probs_RV = sorted_RV.softmax(dim=-1)
            mass_before_RV = _cumsum(probs_RV) - probs_RV
            drop_sorted_RV = mass_before_RV >= rows.top_p_R[:, None]
            drop_RV |= torch.zeros_like(drop_sorted_RV).scatter_(1, order_RV, drop_sorted_RV)
        return z_RV.masked_fill(drop_RV, float("-inf"))


def _cumsum(x_RV: torch.Tensor) -> torch.Tensor:
    """Cumulative sums along the vocabulary. torch's CUDA scan of floats has no deterministic variant
    (it raises under `torch.use_deterministic_algorithms`), so deterministic mode scans on the CPU."""
    if x_RV.is_cuda and torch.are_deterministic_algorithms_enabled():
        return x_RV.cpu().cumsum(dim=-1).to(x_RV.device)
    return x_RV.cumsum(dim=-1)
