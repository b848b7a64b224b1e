"""The vocabulary-parallel logprob head on 2 gloo processes equals `token_logprobs` on one process:
logprobs, entropies and the gradients of hidden states and head weight, alone and on a
tensor-parallel model (tied and untied heads)."""

from __future__ import annotations

import copy

import pytest
import torch
from parallel_helpers import packed_inputs, run_gloo, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from rlloom.models.logprobs import token_logprobs
from rlloom.parallel.tp import apply_tp
from rlloom.parallel.vocab_parallel import vocab_parallel_token_logprobs


def _objective(logp: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    loss = (logp * torch.randn(logp.shape, generator=g)).mean()
    return loss if entropy is None else loss + (entropy * torch.randn(entropy.shape, generator=g)).mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def head_alone(mesh) -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(13, 16), torch.randn(24, 16) * 0.5
    targets = torch.randint(0, 24, (13,))
    assert (targets < 12).any() and (targets >= 12).any()  # both ranks own some targets
    for with_entropy in (True, False):
        h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        kwargs = dict(temperature=0.7, chunk_tokens=5, with_entropy=with_entropy)
        expected = token_logprobs(h_ref, w_ref, targets, **kwargs)
        _objective(*expected).backward()
        h = hidden.clone().requires_grad_()
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        got = vocab_parallel_token_logprobs(h, w, targets, **kwargs)
        _objective(*got).backward()
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert w.grad.placements == (Shard(0),) and w.grad.to_local().shape == (12, 16)
        torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad, atol=1e-5, rtol=1e-5)
    logp, entropy = vocab_parallel_token_logprobs(hidden[:0], w, targets[:0], with_entropy=True)
    assert logp.shape == entropy.shape == (0,)


def head_on_tp_model(mesh, family: str) -> None:
    inputs = packed_inputs([6, 10], vocab=64)
    targets = inputs["input_ids"].roll(-1)
    ref = tiny_model(family)
    model = apply_tp(copy.deepcopy(ref), mesh)
    kwargs = dict(temperature=0.9, chunk_tokens=6, with_entropy=True)
    expected = token_logprobs(ref.hidden_states(**inputs), ref.lm_head_weight, targets, **kwargs)
    _objective(*expected).backward()
    got = vocab_parallel_token_logprobs(
        model.hidden_states(**inputs), model.lm_head_weight, targets, **kwargs
    )
    _objective(*got).backward()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=family)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            _full(param.grad), ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=f"{family} {name}"
        )


def worker(rank: int) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    head_alone(mesh)
    for family in ("qwen3", "deepseek_v3"):  # tied and untied heads
        head_on_tp_model(mesh, family)


def test_vocab_parallel_head_parity():
    run_gloo(worker, 2)


def test_vocab_parallel_head_needs_a_sharded_weight():
    with pytest.raises(ValueError, match="sharded over the vocabulary.*Fix: apply"):
        vocab_parallel_token_logprobs(torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long))
