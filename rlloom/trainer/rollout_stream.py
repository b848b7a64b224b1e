"""The asynchronous loop's producer on the rollout group's step-level producers (`stream_*`, one
`EngineStream` per rollout rank, workers/stream.py): each replica generates in a background thread of
its own process (this one with cluster.mode=inline, each of its actors with Ray, the ranks of a
rollout.tp > 1 replica in lock-step), kept in flight while the controller trains; every
`rollout.partial` mode, every placement and every rollout.tp go through it. Continuous batching runs
every admitted job together: when the oldest is complete, younger ones are part-generated. Jobs and
groups: rollout_jobs.py.

The controller admits jobs (their prompts go to the least loaded replica), polls the finished
samples while it waits for a job (while it trains, the stream's pump does: stream_pump.py; every
change to the stream holds the pump's lock), scores each prompt's group as it completes and draws
dynamic sampling's next round (a job's only once every older job is complete, so the prompts each job
draws do not depend on which responses finish first). New weights arrive between decode steps
(`update_weights`); `rollout.partial` decides what happens to the requests in flight:
- finish: they run to the end under the old weights first, then the weights change;
- abort_resume: they are aborted, the weights change, and each sample resumes from prompt + its
  tokens so far (the KV cache rebuilt by a prefill under the new weights); every token keeps the
  version and the logprob of the policy that produced it (`Sample.token_versions`);
- drop: their tokens are discarded and the samples start again under the new weights.

Multi-turn episodes (`rollout.env`, `rollout.tools`): an `EpisodeDriver` (episodes/driver.py) owns
each prompt's trajectories; a finished turn goes to it instead of into the group, its environment
steps run off this thread while the replicas keep decoding (and the controller trains), and each
next turn is a request of its own on the same replica. A group is scored once all of its trajectories have ended.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from rlloom.agents.driver import AgentDriver
from rlloom.cluster.base import RolloutGroup
from rlloom.config import RunConfig
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.dataset import PromptItem
from rlloom.data.source import Position, PromptSource
from rlloom.data.types import Sample
from rlloom.episodes.driver import EpisodeDriver, TurnRequest
from rlloom.rewards.runner import RewardRunner
from rlloom.trainer.rollout import RolloutResult
from rlloom.trainer.rollout_jobs import ROUND_STRIDE, Job, add_group, group_id, make_sample, round_sampling
from rlloom.trainer.stream_pump import Pump
from rlloom.workers.flights import StreamPartial, StreamRequest, StreamResult

POLL_S = 0.2
"""Longest wait of one poll for finished samples (it returns at the first one)."""
PUMP_POLL_S = 0.05
"""The pump's (while the controller trains): a weight update waits for one such poll at most."""


@dataclass(kw_only=True, slots=True)
class _Request:
    """One prompt of a job in flight and its samples as they complete."""

    job: Job
    item: PromptItem
    n: int
    replica: int
    group_id: int
    order: int
    done: dict[int, Sample] = field(default_factory=dict)
    turns_sent: int = 0
    """Multi-turn: requests sent for the trajectories' later turns (their ids' suffix)."""


class RolloutStream:
    """The producer side of the asynchronous loop, on the rollout group's replicas."""

    def __init__(
        self,
        group: RolloutGroup,
        cfg: RunConfig,
        *,
        source: PromptSource,
        runner: RewardRunner,
        decode: ResponseDecoder,
        stop_token_ids: list[int],
        episodes: EpisodeDriver | AgentDriver | None = None,
    ) -> None:
        self.group, self.cfg, self.source = group, cfg, source
        self.episodes = episodes
        """Multi-turn episodes (an environment, tools, or an agent's sessions: the same calls); None
        for single-turn generation."""
        self.turns: dict[str, tuple[str, int]] = {}
        """Multi-turn: request id of a later turn -> (its prompt's request id, trajectory)."""
        self.turn_left: dict[str, int] = {}
        """Samples of such a request not back yet (an agent group's first requests: one of n)."""
        self.runner, self.decode, self.stop_token_ids = runner, decode, stop_token_ids
        self.jobs: list[Job] = []
        """Jobs admitted and not yet taken, oldest first."""
        self.requests: dict[str, _Request] = {}
        self.unsent: dict[int, list[StreamRequest]] = {}
        """Requests of each replica not handed to it yet (`_send`)."""
        self.load = [0] * group.num_replicas
        """Samples in flight on each replica."""
        self.tokens_discarded = 0
        """Tokens thrown away by `partial=drop` (and by `drop_all`)."""
        self.pump = Pump(self._pump_tick)
        """Every change to the stream holds its lock (`pump.held()`); `pumping()` runs its thread."""

    @property
    def busy_s(self) -> float:
        """Seconds the replicas spent in decode steps so far (their mean)."""
        with self.pump.held():
            return self.group.stream_busy_s

    # ---- admission -------------------------------------------------------------------------------

    def submit(self, index: int) -> Job:
        """Admit the job of batch `index`: draw its prompts (generated once `start` is called)."""
        with self.pump.held():
            job = Job(index=index)
            self.jobs.append(job)
            self._add_round(job, self.cfg.trainer.prompts_per_step)
            return job

    def start(self) -> None:
        """Hand the admitted requests to the replicas (after every admission: the first decode batch
        holds every admitted job)."""
        with self.pump.held():
            self._send()

    def _add_round(self, job: Job, num_prompts: int) -> None:
        positions = self.source.next_positions(num_prompts)
        job.positions.extend(positions)
        items = [self.source.item_at(p) for p in positions]
        sampling = round_sampling(self.cfg, job, len(items), self.stop_token_ids)
        for i, (item, params) in enumerate(zip(items, sampling)):
            request_id = f"{job.index}:{job.rounds}:{i}"
            replica = min(range(len(self.load)), key=lambda r: self.load[r])
            self.load[replica] += params.n
            self.requests[request_id] = _Request(
                job=job,
                item=item,
                n=params.n,
                replica=replica,
                group_id=group_id(job, job.rounds, i),
                order=job.rounds * ROUND_STRIDE + i,
            )
            if self.episodes is not None:  # the first turn is sent once the environments are reset
                self.episodes.begin(request_id, item, params)
                continue
            request = StreamRequest(
                request_id=request_id,
                prompt_ids=list(item.prompt_ids),
                sampling=params,
                prompt_index=i,
                images=item.images,
            )
            self.unsent.setdefault(replica, []).append(request)
        job.outstanding += len(items)
        job.rounds += 1

    def _send(self) -> None:
        unsent, self.unsent = self.unsent, {}
        for replica, requests in sorted(unsent.items()):
            self.group.stream_add(replica, requests)

    # ---- generation ------------------------------------------------------------------------------

    def is_complete(self, job: Job) -> bool:
        """All its prompts are done and it needs (or may draw) no more rounds."""
        return job.is_complete(self.cfg)

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Poll the finished samples (starting dynamic sampling's extra rounds) until `done()` holds."""
        with self.pump.held():
            self._send()
            while not done():
                if not self.requests:
                    raise RuntimeError(
                        "rollout stream: nothing in flight but the awaited jobs are not complete"
                    )
                self._tick(POLL_S)

    def pumping(self) -> AbstractContextManager[None]:
        """Keep the stream going in a background thread for the block's duration (the controller
        trains meanwhile): finished samples booked and scored, environment steps polled, next turns
        and dynamic sampling's rounds sent, as `wait_until` does (stream_pump.py)."""
        return self.pump.running()

    def _pump_tick(self) -> bool:
        """One round of the pump; False with nothing in flight."""
        if not self.requests:
            return False
        self._tick(PUMP_POLL_S)
        return True

    def _tick(self, poll_s: float) -> None:
        """One round: environment steps that came back become next turns, finished samples are
        booked (groups scored), dynamic sampling's next rounds drawn, new requests sent."""
        episodes = self.episodes
        if episodes is not None:
            for turn in episodes.poll(0.0):
                self._send_turn(turn)
            self._finish_episodes()
            self._send()
        # While environments run, poll the replicas briefly so their results are not kept waiting.
        waiting = episodes is not None and episodes.waiting
        for result in self.group.stream_poll(0.01 if waiting else poll_s):
            self._record(result)
        for job in self.jobs:  # dynamic sampling: the next round once a round is done
            if job.needs_round(self.cfg):
                self._add_round(job, job.missing(self.cfg))
            if not self.is_complete(job):  # younger jobs draw after it: an order timing cannot change
                break
        self._send()

    def _record(self, result: StreamResult | StreamPartial) -> None:
        if isinstance(result, StreamPartial):  # an agent's streaming request: its tokens so far
            p = result.partial
            _, j = self.turns.get(p.request_id, (p.request_id, p.sample_index))
            self.episodes.on_progress(j, p)
            return
        c = result.completion
        request_id, j = self.turns.get(c.request_id, (c.request_id, c.sample_index))
        if c.request_id in self.turns:
            self.turn_left[c.request_id] -= 1
            if not self.turn_left[c.request_id]:
                del self.turns[c.request_id], self.turn_left[c.request_id]
        request = self.requests[request_id]
        if c.error is not None:
            raise ValueError(f"rollout rejected prompt {request.item.index}: {c.error}")
        self.load[request.replica] -= 1
        if self.episodes is not None:  # the driver decides whether the trajectory goes on
            self.episodes.on_turn(request_id, j, c, result.versions)
            return
        request.done[c.sample_index] = make_sample(request.item, request.group_id, c, result.versions)
        if len(request.done) == request.n:
            del self.requests[c.request_id]
            group = [request.done[j] for j in range(request.n)]
            add_group(request.job, group, request.order, self.cfg, self.runner, self.decode)

    def _send_turn(self, turn: TurnRequest) -> None:
        """Queue a turn the episode driver asks for, on its prompt's replica (its KV cache is there)."""
        request = self.requests[turn.key]
        request_id = turn.key
        if turn.j is not None:
            request.turns_sent += 1
            request_id = f"{turn.key}/{turn.j}.{request.turns_sent}"
            self.turns[request_id] = (turn.key, turn.j)
            self.turn_left[request_id] = turn.sampling.n
        if turn.turn > 0:  # a first turn's samples were counted when its prompt was admitted
            self.load[request.replica] += turn.sampling.n
        self.unsent.setdefault(request.replica, []).append(
            StreamRequest(
                request_id=request_id,
                prompt_ids=list(turn.prompt_ids),
                sampling=turn.sampling,
                prompt_index=request.order % ROUND_STRIDE,
                progress=turn.progress,
                first_sample=turn.first_sample,
                images=turn.images,
            )
        )

    def _finish_episodes(self) -> None:
        """Score the groups whose trajectories have all ended."""
        for request_id, request in list(self.requests.items()):
            if self.episodes.finished(request_id):
                del self.requests[request_id]
                group = self.episodes.take(request_id, request.group_id)
                add_group(request.job, group, request.order, self.cfg, self.runner, self.decode)

    # ---- weights ---------------------------------------------------------------------------------

    def update_weights(self, sync: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Apply `sync` (which moves the new weights into the replicas) between two decode steps,
        treating the requests in flight as `rollout.partial` says; return the sync's metrics and
        async/tokens_interrupted (tokens of aborted requests, resumed or discarded). Every rank of
        every replica is idle while the weights change (`stream_abort` returns then)."""
        with self.pump.held():
            mode = self.cfg.rollout.partial
            if mode == "finish":
                self.wait_until(lambda: not self.requests)  # nothing is left to abort
            self._send()
            interrupted = self.group.stream_abort()
            metrics = dict(sync())
            if mode != "finish":
                self.tokens_discarded += self.group.stream_resume(keep=mode == "abort_resume")
            metrics["async/tokens_interrupted"] = float(interrupted)
            return metrics

    def admitted(self) -> list[Job]:
        """The jobs admitted and not yet taken, oldest first."""
        with self.pump.held():
            return list(self.jobs)

    def take(self) -> Job:
        """Remove and return the oldest job (complete)."""
        with self.pump.held():
            job = self.jobs.pop(0)
            assert self.is_complete(job), (
                f"job {job.index} taken while {job.outstanding} prompts are in flight"
            )
            return job

    def idle(self) -> None:
        """Wait until every replica's generation thread has ended (nothing may be in flight): the
        engines are then free to sleep or to take new weights outside the stream."""
        with self.pump.held():
            assert not self.requests, f"{len(self.requests)} prompts are still in flight"
            self.group.stream_abort()

    def drop_all(self) -> list[Position]:
        """Abort every request and forget every job; return the prompt-source positions the dropped
        jobs drew (to give them back: they are drawn again), none when nothing was admitted."""
        with self.pump.held():
            self.unsent.clear()
            self.tokens_discarded += self.group.stream_drop()
            self.requests.clear()
            self.turns.clear()
            self.turn_left.clear()
            if self.episodes is not None:
                self.episodes.forget()
            self.load = [0] * len(self.load)
            positions = [p for job in self.jobs for p in job.positions]
            self.jobs.clear()
            return positions


def collect_rollouts(stream: RolloutStream, step: int) -> RolloutResult:
    """The synchronous step's samples: the stream with only this step's job admitted (the
    asynchronous loop at staleness 0), so every mode generates through one path."""
    job = stream.submit(step)
    stream.start()
    stream.wait_until(lambda: stream.is_complete(job))
    stream.take()
    stream.idle()
    return RolloutResult(samples=job.batch(stream.cfg), metrics=job.rollout_metrics())
