"""`AgentDriver`: agents on the rollout stream (`rollout.agent`), in the episode driver's place.

The stream (trainer/rollout_stream.py) calls it as it calls `EpisodeDriver`:
1. `begin(key, item, sampling)`: one session per trajectory, each with its base URL on the endpoint,
   and the agent started on it in a worker (`EnvCalls`, agents/spec.py);
2. `poll()`: the endpoint's requests become engine requests (`TurnRequest`s on the prompt's replica:
   a session's requests stick to one replica and its KV cache); finished agents end their trajectory.
   The sessions' first requests of a group wait for each other (`HOLD_S` at most) and go out as one
   engine request of n samples when they are equal (the agent sent the same prompt), so the engine
   prefills the prompt once and forks the samples, as the environment path's first turn does;
3. `on_turn(key, r, completion, versions)`: engine request r came back: its tokens join the session's
   ledger (agents/ledger.py) and, once every choice of the HTTP request is in, the request is answered
   (a streaming request was sent its tokens as they were sampled: `on_progress`);
4. `finished(key)` once every agent of the group has ended and none of its requests is in flight,
   then `take(key, group_id)`: each session's samples, its reward the agent's (or None: the reward
   function scores the session's last answer; `reward.default_score` when the agent failed).

Budgets: a session's request beyond `rollout.max_turns` generation requests, or whose prompt leaves
no room in the context budget (`rollout.max_total_tokens`), is answered with no tokens and finish
reason "length". Sampling: the run's temperature, top_p and top_k (the ledger must hold the policy's
own samples; a request's other values are ignored, with one warning); max_tokens capped at
`rollout.max_new_tokens` and the room left; seeds from (the prompt's seed, trajectory, request,
choice) unless the request gives one, as the environment path draws them: session j's first answer is
sample j of the prompt's seed, whether it went out with its group's or alone (the same tokens either
way), and its later ones use the environment path's per-turn seeds.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from rlloom.agents.api import Answer, ApiError, Choice, Delta, GenRequest
from rlloom.agents.ledger import Fork, Ledger
from rlloom.agents.server import Call, Endpoint
from rlloom.agents.spec import AgentResult
from rlloom.agents.turns import Formats, StreamCursor, assistant_message, make_choice, render_prompt
from rlloom.data.dataset import PromptItem
from rlloom.data.types import Sample
from rlloom.engines.rollout import Completion, Partial, SamplingParams
from rlloom.episodes.calls import EnvCalls, EnvResult, GroupCalls, prompt_row
from rlloom.episodes.driver import TurnRequest

log = logging.getLogger(__name__)

HOLD_S = 1.0
"""Longest wait of a session's first request for those of its group's running agents (an agent
still queued for a worker is not waited for; one that is slow to send its first request, no longer)."""
SEED_MOD = 2**31 - 1


@dataclass(kw_only=True, slots=True)
class AgentSettings:
    max_turns: int
    max_total_tokens: int
    per_turn: bool
    """`rollout.multi_turn_samples=per_turn`: every request its own sample."""
    default_score: float = 0.0


@dataclass(kw_only=True, slots=True)
class _Session:
    key: Any
    j: int
    ledger: Ledger
    done: bool = False
    error: str | None = None
    result: AgentResult | None = None
    tool_calls: int = 0


@dataclass(kw_only=True, slots=True)
class _Group:
    item: PromptItem
    sampling: SamplingParams
    sessions: list[_Session]
    ids: list[str]
    done: int = 0
    in_flight: int = 0
    """Engine samples sent and not back yet."""
    held: list[_Pending] = field(default_factory=list)
    """First requests waiting for the group's others (`_release`)."""
    held_since: float = 0.0


@dataclass(kw_only=True, slots=True)
class _Pending:
    """One HTTP request being generated: its choices as they come back."""

    call: Call
    session: _Session
    fork: Fork
    choices: list[Choice | None]
    cursors: list[StreamCursor]
    """A streaming request: what of each choice was sent so far."""
    turns: list[TurnRequest]
    """Its engine requests (one a choice), until sent."""


class AgentDriver:
    def __init__(
        self,
        *,
        settings: AgentSettings,
        calls: EnvCalls,
        endpoint: Endpoint,
        fmt: Formats,
        stop_token_ids: list[int],
    ) -> None:
        self.settings, self.pool, self.endpoint, self.fmt = settings, GroupCalls(calls), endpoint, fmt
        self.stop_token_ids = stop_token_ids
        self.groups: dict[Any, _Group] = {}
        self.sessions: dict[str, _Session] = {}
        self.engine: dict[tuple[int, int], tuple[_Pending, int]] = {}
        """(engine request id, sample index) -> (its HTTP request, which choice)."""
        self._ids = itertools.count()
        self._warned = False

    # ---- start ----------------------------------------------------------------------------------

    def begin(self, key: Any, item: PromptItem, sampling: SamplingParams) -> None:
        """Open a session per trajectory and start its agent."""
        n = max(sampling.n, 1)
        ids = [secrets.token_hex(8) for _ in range(n)]
        sessions = [
            _Session(
                key=key, j=j, ledger=Ledger(tokenizer=self.fmt.tokenizer, extend=not self.settings.per_turn)
            )
            for j in range(n)
        ]
        self.groups[key] = _Group(item=item, sampling=sampling, sessions=sessions, ids=ids)
        self.sessions.update(zip(ids, sessions))
        row = prompt_row(item)
        kwargs = {
            "model": self.endpoint.model_id,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
        }
        for j, sid in enumerate(ids):
            self.pool.submit(key, j, None, "run", (self.endpoint.session_url(sid), row, dict(kwargs)))

    # ---- requests and answers -------------------------------------------------------------------

    def poll(self, timeout_s: float) -> list[TurnRequest]:
        """Engine requests for the endpoint's new requests; agents that ended end their trajectory."""
        out = [t for call in self.endpoint.take() for t in self._on_call(call)]
        for key, j, result in self.pool.poll(0.0 if out else timeout_s):
            if key in self.groups:
                self._on_agent(self.groups[key], j, result)
        now, queued = time.monotonic(), self.pool.queued()
        for group in self.groups.values():
            waited = all(s.done or s.ledger.requests or (s.key, s.j) in queued for s in group.sessions)
            if group.held and (waited or now - group.held_since >= HOLD_S):
                out += self._release(group)
        return out

    def _on_call(self, call: Call) -> list[TurnRequest]:
        session = self.sessions.get(call.session or "")
        if session is None or session.done:
            call.reply(ApiError(404, f"no session {call.session!r} (its agent ended, or it never existed)"))
            return []
        group, req, ledger = self.groups[session.key], call.request, session.ledger
        try:
            fork = ledger.fork(render_prompt(self.fmt, req))
        except Exception as e:  # noqa: BLE001 - a template error on the agent's messages is its request's
            call.reply(
                ApiError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}")
            )
            return []
        room = self.settings.max_total_tokens - len(fork.prompt_ids)
        if room < 1 or ledger.requests >= self.settings.max_turns:
            empty = Choice(token_ids=[], logprobs=[], pieces=[], text="", finish_reason="length")
            call.reply(Answer(choices=[empty] * req.n, prompt_tokens=len(fork.prompt_ids)))
            return []
        self._warn_sampling(req, group.sampling)
        cursors = [StreamCursor(fmt=self.fmt, req=req) for _ in range(req.n if req.stream else 0)]
        turns = []
        for i in range(req.n):
            sampling, first_sample = self._sampling(group.sampling, req, session, i, room)
            # The admitted load of a trajectory is its first request's (the stream's count).
            first = ledger.requests == 0 and i == 0
            turns.append(
                TurnRequest(
                    key=session.key,
                    j=None,
                    prompt_ids=fork.prompt_ids,
                    sampling=sampling,
                    turn=0 if first else 1,
                    progress=req.stream,
                    first_sample=first_sample,
                )
            )
        pending = _Pending(
            call=call, session=session, fork=fork, choices=[None] * req.n, cursors=cursors, turns=turns
        )
        joinable = ledger.requests == 0 and req.n == 1 and req.seed is None
        ledger.requests += 1
        if joinable:  # sent with the group's other first requests (`poll`)
            group.held_since = group.held_since if group.held else time.monotonic()
            group.held.append(pending)
            return []
        out = []
        for i, turn in enumerate(turns):  # each choice its own engine request (its own seed)
            r = next(self._ids)
            self.engine[(r, turn.first_sample)] = (pending, i)
            group.in_flight += 1
            out.append(dataclasses.replace(turn, j=r))
        return out

    def _send_joint(self, group: _Group, run: list[_Pending]) -> TurnRequest:
        """One engine request of n = len(run) samples for the equal first requests of consecutive
        sessions (one choice each): sample k is session `run[0]`'s j + k."""
        r, first = next(self._ids), run[0].turns[0]
        for k, p in enumerate(run):
            self.engine[(r, first.first_sample + k)] = (p, 0)
        group.in_flight += len(run)
        return dataclasses.replace(first, j=r, sampling=dataclasses.replace(first.sampling, n=len(run)))

    def _sampling(
        self, base: SamplingParams, req: GenRequest, s: _Session, i: int, room: int
    ) -> tuple[SamplingParams, int]:
        """Request i's sampling and its first sample index (the noise it draws)."""
        first_sample = 0
        if req.seed is not None:
            seed = (req.seed * 1_000_003 + i) % SEED_MOD
        elif s.ledger.requests == 0 and i == 0:  # the environment path's first turn: sample j of the prompt
            seed, first_sample = base.seed, s.j
        elif base.seed is None:
            seed = None
        else:  # its later turns' seeds (`EpisodeDriver._request`), another choice's apart
            seed = (base.seed * 1_000_003 + s.j * 7_919 + s.ledger.requests + 131 * i) % SEED_MOD
        limit = min(req.max_tokens or base.max_new_tokens, base.max_new_tokens, room)
        sampling = dataclasses.replace(
            base, n=1, seed=seed, max_new_tokens=limit, stop_strings=[*base.stop_strings, *req.stop]
        )
        return sampling, first_sample

    def _release(self, group: _Group) -> list[TurnRequest]:
        """Send the held first requests: each run of equal requests of consecutive sessions as one
        engine request (its prompt prefilled once), the others alone."""
        held = sorted((p for p in group.held if not p.session.done), key=lambda p: p.session.j)
        group.held = []
        out, run = [], []
        for p in held:
            if run and (run[-1].session.j + 1 != p.session.j or run[-1].turns[0] != _renumbered(p)):
                out.append(self._send_joint(group, run))
                run = []
            run.append(p)
        if run:
            out.append(self._send_joint(group, run))
        return out

    def _warn_sampling(self, req: GenRequest, base: SamplingParams) -> None:
        asked = {"temperature": req.temperature, "top_p": req.top_p}
        run = {"temperature": base.temperature, "top_p": base.top_p}
        if not self._warned and any(v is not None and v != run[k] for k, v in asked.items()):
            self._warned = True
            log.warning(
                "an agent asked for %s; training sessions sample with the run's rollout.temperature=%g and "
                "rollout.top_p=%g (the policy's own samples), so the request's values are ignored",
                {k: v for k, v in asked.items() if v is not None},
                base.temperature,
                base.top_p,
            )

    def on_progress(self, r: int, partial: Partial) -> None:
        """Engine request r's tokens so far (a streaming request): send what may be sent of them."""
        pending, i = self.engine.get((r, partial.sample_index), (None, 0))
        if pending is None or pending.session.done:
            return
        pieces, logprobs = pending.cursors[i].advance(partial.token_ids, partial.logprobs)
        if pieces:
            pending.call.send(Delta(index=i, pieces=pieces, logprobs=logprobs))

    def on_turn(self, key: Any, r: int, c: Completion, versions: list[int]) -> None:
        """Engine request r came back: record its tokens; answer the HTTP request once it is whole."""
        pending, i = self.engine.pop((r, c.sample_index))
        group = self.groups[key]
        group.in_flight -= 1
        session, req = pending.session, pending.call.request
        if session.done:
            return  # its agent ended meanwhile: nobody reads the answer, and nothing is trained on it
        choice = make_choice(self.fmt, req, list(c.token_ids), list(c.logprobs), c.finish_reason)
        if choice.token_ids:
            messages = [*req.messages, assistant_message(choice)] if req.kind == "chat" else []
            session.ledger.record(
                pending.fork,
                choice.token_ids,
                choice.logprobs,
                versions[: len(choice.token_ids)],
                finish_reason="length" if choice.finish_reason == "length" else "stop",
                messages=messages,
                routed_experts=c.routed_experts,
            )
        session.tool_calls += len(choice.tool_calls)
        pending.choices[i] = choice
        if all(ch is not None for ch in pending.choices):
            pending.call.reply(
                Answer(choices=list(pending.choices), prompt_tokens=len(pending.fork.prompt_ids))
            )

    def _on_agent(self, group: _Group, j: int, result: EnvResult) -> None:
        session = group.sessions[j]
        session.done = True
        if result.error is not None:
            session.error = f"the agent failed: {result.error}"
            log.warning("rollout.agent: trajectory %d of prompt %s: %s", j, group.item.index, session.error)
        else:
            session.result = result.value
        group.done += 1

    # ---- the stream's view ----------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """Agents are running (their requests may arrive at any time)."""
        return self.pool.waiting

    def finished(self, key: Any) -> bool:
        group = self.groups.get(key)
        return group is not None and group.done == len(group.sessions) and group.in_flight == 0

    def take(self, key: Any, group_id: int) -> list[Sample]:
        """The samples of a finished group; forgets the group."""
        group = self.groups.pop(key)
        for sid in group.ids:
            self.sessions.pop(sid, None)
        return [s for session in group.sessions for s in self._samples(group, session, group_id)]

    def forget(self) -> None:
        """Drop every group (the stream dropped its requests): waiting requests get a 503."""
        held = [p for group in self.groups.values() for p in group.held]
        for pending in {id(p): p for p in [*held, *(p for p, _ in self.engine.values())]}.values():
            pending.call.reply(ApiError(503, "the rollout was dropped (the run is stopping or restarting)"))
        for session in self.sessions.values():
            session.done = True
        self.groups.clear()
        self.sessions.clear()
        self.engine.clear()
        self.pool.forget()

    def close(self) -> None:
        self.pool.close()
        self.endpoint.close()

    # ---- samples --------------------------------------------------------------------------------

    def _samples(self, group: _Group, session: _Session, group_id: int) -> list[Sample]:
        item, ledger = group.item, session.ledger
        leaves = [b for b in ledger.leaves() if b.segment.response_ids]
        reward = self.settings.default_score if session.error else session.result.reward
        episode = {
            "turns": ledger.requests,
            "tool_calls": session.tool_calls,
            "tool_errors": 0,
            "env_error": None,
            "agent_error": session.error,
            "env_tokens": sum(len(b.segment.loss_mask) - sum(b.segment.loss_mask) for b in leaves),
            "env_metrics": {} if session.result is None else dict(session.result.metrics),
        }
        answer_ids = list(ledger.last.answer_ids) if ledger.last is not None else []
        if not leaves:  # the agent generated nothing: one empty sample, so the group keeps its size
            stop = self.stop_token_ids[0] if self.stop_token_ids else 0
            return [
                Sample(
                    prompt_ids=list(item.prompt_ids),
                    response_ids=[stop],
                    rollout_logprobs=[0.0],
                    loss_mask=[0],
                    group_id=group_id,
                    token_versions=[0],
                    metadata=self._metadata(item, [], answer_ids, reward, episode),
                )
            ]
        return [
            Sample(
                prompt_ids=list(b.segment.prompt_ids),
                response_ids=list(b.segment.response_ids),
                rollout_logprobs=list(b.segment.logprobs),
                loss_mask=list(b.segment.loss_mask),
                group_id=group_id,
                finish_reason=b.finish_reason,
                policy_version=b.segment.versions[0],
                token_versions=list(b.segment.versions),
                routed_experts=b.segment.routed_experts,
                trajectory_id=group_id * 1_000 + session.j if len(leaves) > 1 else None,
                metadata=self._metadata(item, b.messages, answer_ids, reward, episode),
            )
            for b in leaves
        ]

    @staticmethod
    def _metadata(
        item: PromptItem, messages: list, answer_ids: list[int], reward: float | None, episode: dict
    ) -> dict:
        return {
            "ground_truth": item.ground_truth,
            "index": item.index,
            "prompt": item.prompt,
            "columns": item.metadata,
            "messages": [dict(m) for m in messages],
            "answer_ids": answer_ids,
            "env_reward": reward,
            "episode": episode,
        }


def _renumbered(p: _Pending) -> TurnRequest:
    """The first choice's engine request of a held first request as the previous session's would be
    (its sample index one less): equal ones join one engine request."""
    t = p.turns[0]
    return dataclasses.replace(t, first_sample=t.first_sample - 1)
