"""Sample / RolloutBatch: packed and padded layouts against a per-sample reference."""

import random

import pytest
import torch

from rlloom.data.types import RolloutBatch, Sample


def _random_samples(rng: random.Random, n: int) -> list[Sample]:
    out = []
    for g in range(n):
        p, r = rng.randint(1, 7), rng.randint(0, 6)
        mask = [rng.randint(0, 1) for _ in range(r)] if rng.random() < 0.5 else None
        out.append(
            Sample(
                prompt_ids=[rng.randint(1, 50) for _ in range(p)],
                response_ids=[rng.randint(1, 50) for _ in range(r)],
                rollout_logprobs=[-rng.random() for _ in range(r)],
                loss_mask=mask,
                reward=rng.random(),
                group_id=g // 2,
            )
        )
    return out


@pytest.mark.parametrize("seed", range(5))
def test_packed_gather_index_points_at_predicting_position(seed):
    rng = random.Random(seed)
    samples = _random_samples(rng, rng.randint(1, 6))
    batch = RolloutBatch(samples)
    packed = batch.packed()
    assert packed.cu_seqlens[-1].item() == packed.input_ids_N.numel() == batch.num_tokens
    for b, s in enumerate(samples):
        start = packed.cu_seqlens[b].item()
        assert packed.input_ids_N[start : start + s.num_tokens].tolist() == s.token_ids
        assert packed.position_ids_N[start : start + s.num_tokens].tolist() == list(range(s.num_tokens))
        for t, tok in enumerate(s.response_ids):
            # The position predicting response token t holds the token before it; its target is tok.
            pos = packed.gather_index_BT[b, t].item()
            assert packed.target_ids_N[pos].item() == tok
            assert packed.input_ids_N[pos].item() == s.token_ids[len(s.prompt_ids) + t - 1]
        mask = s.response_loss_mask()
        assert packed.response_mask_BT[b, : len(mask)].tolist() == [bool(m) for m in mask]
        assert not packed.response_mask_BT[b, len(mask) :].any()


@pytest.mark.parametrize("seed", range(5))
def test_padded_matches_packed(seed):
    rng = random.Random(seed)
    batch = RolloutBatch(_random_samples(rng, rng.randint(1, 6)))
    packed, padded = batch.packed(), batch.padded()
    mask = packed.response_mask_BT
    assert torch.equal(mask, padded.response_mask_BT)
    tgt_packed = packed.target_ids_N[packed.gather_index_BT]
    tgt_padded = padded.target_ids_BL.reshape(-1)[padded.gather_index_BT]
    assert torch.equal(tgt_packed[mask], tgt_padded[mask])
    assert padded.attention_mask_BL.sum().item() == batch.num_tokens


def test_select_keeps_width_and_rollout_logprobs():
    samples = _random_samples(random.Random(0), 6)
    batch = RolloutBatch(samples)
    sub = batch.select([4, 1])
    assert sub.T == batch.T
    assert torch.equal(sub.rollout_logprobs(), batch.rollout_logprobs()[[4, 1]])
    assert torch.equal(sub.rewards(), batch.rewards()[[4, 1]])


def test_bad_records_raise():
    with pytest.raises(ValueError, match="rollout logprobs"):
        Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[0.0])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        Sample(prompt_ids=[], response_ids=[2])
    with pytest.raises(ValueError, match="at least one sample"):
        RolloutBatch([])
    with pytest.raises(ValueError, match="num_response_tokens"):
        RolloutBatch([Sample(prompt_ids=[1], response_ids=[2, 3])], num_response_tokens=1)
