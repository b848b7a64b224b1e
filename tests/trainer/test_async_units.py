"""Pieces of the asynchronous loop without a model: the staleness split, the async config, the
settings' one-line errors, per-token versions in `Sample`, the order of dynamic sampling's rounds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlloom.config import ConfigError, load_config
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.dataset import PromptItem
from rlloom.data.source import PromptSource
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.rollout import Completion
from rlloom.rewards.runner import RewardRunner
from rlloom.trainer.async_loop import async_config, capacity, drains_after, split_stale
from rlloom.trainer.rollout_stream import RolloutStream
from rlloom.workers.flights import StreamRequest, StreamResult


def cfg(*overrides: str):
    return load_config("arithmetic_smoke", list(overrides))


def sample(versions: list[int]) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2] * len(versions), token_versions=versions)


def test_split_stale_drops_or_downweights_samples_beyond_the_bound():
    samples = [sample([3, 3]), sample([2, 3]), sample([1, 2]), sample([0, 3])]
    c = cfg("trainer.mode=async", "trainer.max_staleness=1")
    kept, m = split_stale(samples, c, train_version=3)
    assert kept == samples[:2]
    assert (
        m["async/staleness_0"],
        m["async/staleness_1"],
        m["async/staleness_2"],
        m["async/staleness_3"],
    ) == (1, 1, 1, 1)
    assert m["async/samples_dropped"] == 2 and (m["async/version_min"], m["async/version_max"]) == (0, 3)

    c = cfg("trainer.mode=async", "trainer.max_staleness=1", "trainer.stale_samples=downweight")
    kept, m = split_stale(samples, c, train_version=3)
    assert [s.loss_weight for s in kept] == [1.0, 1.0, 0.5, 0.25] and m["async/samples_downweighted"] == 2
    assert RolloutBatch(kept).loss_weights().tolist() == [1.0, 1.0, 0.5, 0.25]


def test_staleness_counts_rl_steps_when_a_step_makes_several_optimizer_steps():
    c = cfg("trainer.mode=async", "trainer.max_staleness=1", "trainer.num_mini_batches=2")
    kept, m = split_stale([sample([4]), sample([2]), sample([1])], c, train_version=4)
    assert len(kept) == 2 and m["async/staleness_2"] == 1  # version 1 is 3 updates = 2 steps old


def test_queue_capacity_and_drain_points():
    assert capacity(cfg("trainer.mode=async", "trainer.max_staleness=2")) == 3
    assert capacity(cfg("trainer.mode=one_step_off")) == 2
    c = cfg("trainer.mode=async", "trainer.total_steps=6", "trainer.save_every=4", "trainer.eval_every=3")
    assert [s for s in range(1, 7) if drains_after(c, s)] == [3, 4, 6]


def test_async_modes_correct_off_policy_samples_by_default():
    assert async_config(cfg("trainer.mode=async")).algorithm.is_correction == "tis"
    assert (
        async_config(cfg("trainer.mode=async", "algorithm.is_correction=mis")).algorithm.is_correction
        == "mis"
    )
    decoupled = async_config(cfg("trainer.mode=one_step_off", "algorithm.decoupled_ppo=true")).algorithm
    assert (decoupled.is_correction, decoupled.is_level, decoupled.is_low) == ("mis", "token", 0.0)
    assert not async_config(cfg("trainer.mode=async")).rollout.sleep_during_train


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.max_staleness=-1"], "trainer.max_staleness=-1 is invalid: must be >= 0"),
        (["trainer.mode=later"], "trainer.mode"),
        (["rollout.partial=abort_resume"], "rollout.partial='abort_resume' is invalid"),
        (["algorithm.decoupled_ppo=true"], "algorithm.decoupled_ppo=True is invalid: needs trainer.mode"),
        (["trainer.stale_samples=weigh"], "trainer.stale_samples"),
    ],
)
def test_bad_async_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        cfg(*overrides)
    assert "\n" not in str(e.value) and ("Fix:" in str(e.value) or "must be one of" in str(e.value))


@pytest.mark.parametrize("partial", ["finish", "abort_resume", "drop"])
def test_every_partial_mode_on_a_tensor_parallel_ray_replica(partial):
    ray_tp2 = ["cluster.mode=ray", "cluster.placement=separate", "cluster.rollout_workers=2", "rollout.tp=2"]
    c = cfg("trainer.mode=async", f"rollout.partial={partial}", *ray_tp2)
    assert (c.rollout.partial, c.rollout.tp) == (partial, 2)


def test_sample_token_versions():
    s = sample([1, 2, 2])
    assert s.oldest_version == 1 and RolloutBatch([s, sample([5])]).token_versions().tolist() == [
        [1, 2, 2],
        [5, 0, 0],
    ]
    assert Sample(prompt_ids=[1], response_ids=[2], policy_version=4).response_versions() == [4]
    with pytest.raises(ValueError, match="2 token versions for 1 response tokens"):
        Sample(prompt_ids=[1], response_ids=[2], token_versions=[1, 2])


class YoungestFirst:
    """A rollout group whose requests finish youngest job first, one request a poll."""

    num_replicas = 1
    stream_busy_s = 0.0

    def __init__(self) -> None:
        self.pending: list[StreamRequest] = []

    def stream_add(self, replica: int, requests: list[StreamRequest]) -> None:
        self.pending.extend(requests)

    def stream_poll(self, timeout_s: float) -> list[StreamResult]:
        request = max(self.pending, key=lambda r: int(r.request_id.split(":")[0]))  # "job:round:position"
        self.pending.remove(request)
        return [
            StreamResult(
                completion=Completion(
                    request_id=request.request_id,
                    prompt_index=request.prompt_index,
                    sample_index=j,
                    token_ids=[7],
                    logprobs=[-1.0],
                    finish_reason="stop",
                    policy_version=0,
                ),
                versions=[0],
            )
            for j in range(request.sampling.n)
        ]


def test_dynamic_sampling_draws_a_jobs_extra_rounds_after_every_older_jobs_whatever_finishes_first():
    # Every group ties (reward 0), so each job draws all 3 rounds. The younger job's first round
    # finishes first; before, it then drew the next prompt, so which prompts each job got depended on
    # which responses finished first (thread timing), and a resumed run could differ.
    c = cfg(
        "trainer.mode=async",
        "trainer.prompts_per_step=1",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=3",
    )
    items = [
        PromptItem(prompt_ids=[i + 1], prompt_text=str(i), ground_truth=str(i), index=i) for i in range(9)
    ]
    source = PromptSource(items, shuffle=False)
    runner = RewardRunner(lambda response_text, ground_truth: 0.0)
    decode = ResponseDecoder(SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids)), frozenset())
    stream = RolloutStream(YoungestFirst(), c, source=source, runner=runner, decode=decode, stop_token_ids=[])
    jobs = [stream.submit(0), stream.submit(1)]
    stream.wait_until(lambda: all(stream.is_complete(job) for job in jobs))
    assert [[source.item_at(p).index for p in job.positions] for job in jobs] == [[0, 2, 3], [1, 4, 5]]
    assert [job.num_groups_dropped for job in jobs] == [3, 3]
