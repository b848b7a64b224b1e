"""`EpisodeDriver`: multi-turn episodes on the rollout stream (`rollout.env`, `rollout.tools`).

The stream (trainer/rollout_stream.py) generates; the driver decides what happens between turns:
1. `begin(key, item, n)`: one environment per trajectory, `reset(row)` each (off this thread);
2. `first_requests(key)`, once every reset is back: the first turn of the n trajectories, one
   request of n samples when they start from the same messages (the samples then share the prompt's
   KV cache, and with no `reset` messages and no tools the prompt ids are the plain single-turn ones),
   else one request each;
3. `on_turn(key, j, completion, versions)`: the turn's sampled tokens join trajectory j; the driver
   asks its environment for a step (unless a budget or the finish reason ends it);
4. `poll()`: environment steps that came back become the next turn's request (the tokens so far
   plus the rendered observations) or end the trajectory; a request's group is done when its n
   trajectories are (`finished(key)`).

Budgets: `rollout.max_turns` (turns generated), `rollout.max_total_tokens` (a trajectory's context;
reaching it ends it with finish reason "length"), `rollout.max_observation_tokens` (each
observation's content, truncated on `rollout.observation_truncation`'s side).
Seeds: a trajectory's turn t >= 1 draws from seed (request seed, sample j, turn t), so it does not
depend on which other trajectories are in flight.
Pictures (a vision-language model): a row's pictures ride every turn of its trajectories and their
samples, whose prompts extend the row's prompt token for token (it holds the pictures'
placeholders; the messages the environment sees are the row's text). A trajectory whose prompt is
rendered anew instead (an environment's `reset` messages, tools, a chat template that rewrites
earlier turns) would lose them: it ends with an environment error (`PICTURES_EXTEND`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlloom.data.chat import prompt_messages
from rlloom.data.dataset import PromptItem
from rlloom.data.images import ImageInputs
from rlloom.data.types import Sample
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.episodes.calls import EnvCalls, EnvResult, GroupCalls, prompt_row
from rlloom.episodes.render import Rendered, encode, extension_ids, render_conversation
from rlloom.episodes.tools import TOOL_PARSERS, strip_tool_calls
from rlloom.episodes.trajectory import Segment, Trajectory, truncate_ids
from rlloom.episodes.types import Message

log = logging.getLogger(__name__)

PICTURES_EXTEND = (
    "the row has pictures, which ride only turns whose prompt extends the row's prompt token for token, "
    "and this trajectory's prompt was rendered anew (reset messages, tools, or a chat template that "
    "rewrites earlier turns); fix: return None from reset and use rollout.env without tools and with "
    "rollout.multi_turn_samples=trajectory or auto with a template that keeps earlier turns"
)
"""Why a trajectory of a row with pictures ended: its prompt no longer holds their placeholders."""


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """A request the stream must send: `n` samples of `prompt_ids` for trajectory `j` (None: the
    first turn of all n trajectories at once)."""

    key: Any
    j: int | None
    prompt_ids: list[int]
    sampling: SamplingParams
    turn: int = 0
    """Turns the trajectory generated before this one (0: its first)."""
    progress: bool = False
    """Report the tokens as they are sampled (`AgentDriver.on_progress`: a streaming request)."""
    first_sample: int = 0
    """The first sample's index (its seeded noise's: `RolloutEngine.add_request`)."""
    images: ImageInputs | None = None
    """The row's pictures (a vision-language model): `prompt_ids` start with the row's prompt."""


@dataclass(kw_only=True, slots=True)
class _Group:
    item: PromptItem
    sampling: SamplingParams
    """The first turn's sampling (n samples, the request's seed)."""
    trajs: list[Trajectory | None]
    resets_left: int
    done: int = 0


@dataclass(kw_only=True, slots=True)
class EpisodeSettings:
    """The rollout settings the driver uses (from `RolloutConfig` and the data section)."""

    max_turns: int
    max_total_tokens: int
    max_observation_tokens: int
    observation_truncation: str
    multi_turn_samples: str
    tool_parser: str
    system_prompt: str = ""
    tools: list[dict[str, Any]] | None = None
    """The tools' JSON schemas, rendered by the chat template (None: no tools)."""
    template_renders_tool_calls: bool = False
    """The chat template writes an assistant message's `tool_calls` itself (Qwen's does): its
    `content` then holds only the text around the calls, as the template expects."""
    default_score: float = 0.0


@dataclass(kw_only=True, slots=True)
class EpisodeDriver:
    settings: EpisodeSettings
    calls: EnvCalls
    tokenizer: Any
    stop_token_ids: list[int]
    decode: Callable[[list[int]], str]
    """The run's response decoding (control tokens inside a turn visible, its final stop token left
    out): an assistant message's content."""
    groups: dict[Any, _Group] = field(default_factory=dict)
    pool: GroupCalls = field(init=False)
    """`calls` as the driver uses them: a call per trajectory, those of forgotten groups ignored."""

    def __post_init__(self) -> None:
        self.pool = GroupCalls(self.calls)

    # ---- start ----------------------------------------------------------------------------------

    def begin(self, key: Any, item: PromptItem, sampling: SamplingParams) -> None:
        """Build and reset the n environments of one prompt."""
        n = max(sampling.n, 1)
        self.groups[key] = _Group(item=item, sampling=sampling, trajs=[None] * n, resets_left=n)
        row = prompt_row(item)
        for j in range(n):
            self.pool.submit(key, j, None, "reset", row)

    def _on_reset(self, key: Any, j: int, result: EnvResult) -> list[TurnRequest]:
        group = self.groups[key]
        messages = result.value if result.error is None else None
        if messages is None:
            messages = prompt_messages(group.item.prompt, self.settings.system_prompt)
        traj = Trajectory(messages=messages, segments=[], env=result.env, env_error=result.error)
        group.trajs[j] = traj
        group.resets_left -= 1
        if group.resets_left:
            return []
        return self._first_turns(key, group)

    def _first_turns(self, key: Any, group: _Group) -> list[TurnRequest]:
        for j, traj in enumerate(group.trajs):
            if traj.env_error is not None:
                self._end(key, j, reason="stop")
        live = [j for j, t in enumerate(group.trajs) if not t.done]
        plain = not self.settings.tools
        prompts = {
            j: (
                list(group.item.prompt_ids)
                if plain
                and group.trajs[j].messages == prompt_messages(group.item.prompt, self.settings.system_prompt)
                else encode(self.tokenizer, self._render(group.trajs[j].messages))
            )
            for j in live
        }
        for j in live:
            if group.item.images is not None and prompts[j] != group.item.prompt_ids:
                group.trajs[j].env_error = PICTURES_EXTEND  # ends as a failed reset does
                self._end(key, j, reason="stop")
            else:
                group.trajs[j].segments.append(Segment(prompt_ids=prompts[j]))
        live = [j for j in live if not group.trajs[j].done]
        if len(live) == len(group.trajs) and all(prompts[j] == prompts[live[0]] for j in live):
            return [
                TurnRequest(
                    key=key,
                    j=None,
                    prompt_ids=prompts[live[0]],
                    sampling=group.sampling,
                    images=group.item.images,
                )
            ]
        return [self._request(key, j, turn=0) for j in live]

    # ---- turns ----------------------------------------------------------------------------------

    def on_turn(self, key: Any, j: int, c: Completion, versions: list[int]) -> None:
        """Trajectory j's turn came back: record it, then end the trajectory or ask for a step."""
        group = self.groups[key]
        traj = group.trajs[j]
        traj.add_turn(list(c.token_ids), list(c.logprobs), versions)
        traj.last_turn_ids = list(c.token_ids)
        traj.current.routed_experts = c.routed_experts
        text = self.decode(list(c.token_ids))
        message: Message = {"role": "assistant", "content": text}
        calls, errors = TOOL_PARSERS[self.settings.tool_parser](text)
        if calls:
            message["tool_calls"] = [call.as_message_entry() for call in calls]
            if self.settings.template_renders_tool_calls:  # it writes them itself: content is the rest
                message["content"] = strip_tool_calls(text)
        traj.tool_calls += len(calls) + len(errors)
        traj.messages.append(message)
        if c.finish_reason != "stop":
            return self._end(key, j, reason=c.finish_reason)
        self.pool.submit(key, j, traj.env, "step", [dict(m) for m in traj.messages])

    def _on_step(self, key: Any, j: int, result: EnvResult) -> list[TurnRequest]:
        group = self.groups[key]
        traj = group.trajs[j]
        if result.error is not None:
            traj.env_error = result.error
            return self._end(key, j, reason="stop") or []
        step = result.value
        traj.env = result.env
        for name, value in step.metrics.items():
            traj.metrics[name] = traj.metrics.get(name, 0.0) + value
        traj.tool_errors += int(step.metrics.get("tool_errors", 0))
        if step.done:
            traj.reward = step.reward
            return self._end(key, j, reason="stop") or []
        if traj.turns >= self.settings.max_turns:
            return self._end(key, j, reason="length") or []
        observations = [self._truncated(m) for m in step.observations]
        traj.messages += observations
        rendered = self._render(traj.messages)
        ext = None
        if self.settings.multi_turn_samples != "per_turn":
            ext = extension_ids(self.tokenizer, self._as_written(group, traj.current.token_ids), rendered)
        if ext is None and group.item.images is not None:
            traj.env_error = PICTURES_EXTEND
            return self._end(key, j, reason="stop") or []
        if ext is None and self.settings.multi_turn_samples == "trajectory":
            traj.env_error = (
                "the chat template does not extend the previous turns (it rewrote them); fix: set "
                "rollout.multi_turn_samples=auto to train each such turn as its own sample"
            )
            return self._end(key, j, reason="stop") or []
        # The context budget: a trajectory whose next prompt would not leave room for a token ends here
        # (before its observations join it, so its tokens are exactly those the engine saw).
        next_len = len(encode(self.tokenizer, rendered)) if ext is None else traj.num_tokens + len(ext)
        if next_len + 1 >= self.settings.max_total_tokens:
            return self._end(key, j, reason="length") or []
        if ext is None:
            traj.start_segment(encode(self.tokenizer, rendered))
        else:
            traj.add_observation(ext, version=traj.current.versions[-1])
        return [self._request(key, j, turn=traj.turns)]

    def poll(self, timeout_s: float) -> list[TurnRequest]:
        """Requests for the turns whose environment calls came back."""
        out: list[TurnRequest] = []
        for key, j, result in self.pool.poll(timeout_s):
            group = self.groups.get(key)
            if group is None:
                continue  # its group was dropped (a drain before a checkpoint)
            out += self._on_reset(key, j, result) if group.trajs[j] is None else self._on_step(key, j, result)
        return out

    @property
    def waiting(self) -> bool:
        """Environment calls are in flight."""
        return self.pool.waiting

    def finished(self, key: Any) -> bool:
        group = self.groups.get(key)
        return group is not None and group.done == len(group.trajs)

    def take(self, key: Any, group_id: int) -> list[Sample]:
        """The samples of a finished group (one per trajectory, or per segment); forgets the group."""
        group = self.groups.pop(key)
        return [s for j, traj in enumerate(group.trajs) for s in self._samples(group, traj, group_id, j)]

    def forget(self) -> None:
        """Drop every group (the stream dropped its requests); calls in flight are ignored."""
        self.groups.clear()
        self.pool.forget()

    def close(self) -> None:
        self.pool.close()

    # ---- helpers --------------------------------------------------------------------------------

    def _request(self, key: Any, j: int, *, turn: int) -> TurnRequest:
        group = self.groups[key]
        traj = group.trajs[j]
        base = group.sampling
        seed = None if base.seed is None else (base.seed * 1_000_003 + j * 7_919 + turn) % (2**31 - 1)
        room = self.settings.max_total_tokens - traj.num_tokens
        sampling = dataclasses.replace(
            base, n=1, seed=seed, max_new_tokens=max(1, min(base.max_new_tokens, room))
        )
        return TurnRequest(
            key=key,
            j=j,
            prompt_ids=traj.current.token_ids,
            sampling=sampling,
            turn=turn,
            images=group.item.images,
        )

    def _end(self, key: Any, j: int, *, reason: str) -> None:
        group = self.groups[key]
        traj = group.trajs[j]
        traj.done, traj.finish_reason = True, reason
        if traj.env_error is not None:
            traj.reward = self.settings.default_score
        group.done += 1

    def _render(self, messages: list[Message]) -> Rendered:
        return render_conversation(self.tokenizer, messages, tools=self.settings.tools)

    def _as_written(self, group: _Group, ids: list[int]) -> list[int]:
        """`ids` as the chat template writes the trajectory's messages: a row's pictures are not among
        them (they ride as `images`), so the row's prompt ids, each picture's placeholders expanded,
        stand as its messages rendered without pictures."""
        item = group.item
        if item.images is None:
            return ids
        messages = prompt_messages(item.prompt, self.settings.system_prompt)
        return encode(self.tokenizer, self._render(messages)) + ids[len(item.prompt_ids) :]

    def _truncated(self, message: Message) -> Message:
        limit = self.settings.max_observation_tokens
        ids = list(
            self.tokenizer.encode(message["content"], add_special_tokens=False, split_special_tokens=True)
        )
        if len(ids) <= limit:
            return message
        kept = truncate_ids(ids, limit, self.settings.observation_truncation)
        return {**message, "content": self.tokenizer.decode(kept, skip_special_tokens=False)}

    def _samples(self, group: _Group, traj: Trajectory, group_id: int, traj_index: int) -> list[Sample]:
        item = group.item
        stats = {
            "turns": traj.turns,
            "tool_calls": traj.tool_calls,
            "tool_errors": traj.tool_errors,
            "env_error": traj.env_error,
            "env_tokens": traj.env_tokens(),
            "env_metrics": dict(traj.metrics),
        }
        segments = [s for s in traj.segments if s.response_ids] or traj.segments[-1:]
        out = []
        for seg in segments:
            if not seg.response_ids:  # the environment failed before the first turn: an empty sample
                seg = dataclasses.replace(
                    seg, response_ids=[self.stop_token_ids[0] if self.stop_token_ids else 0]
                )
                seg.loss_mask, seg.logprobs, seg.versions = [0], [0.0], [0]
            out.append(
                Sample(
                    prompt_ids=list(seg.prompt_ids),
                    response_ids=list(seg.response_ids),
                    rollout_logprobs=list(seg.logprobs),
                    loss_mask=list(seg.loss_mask),
                    group_id=group_id,
                    finish_reason=traj.finish_reason,
                    policy_version=seg.versions[0],
                    token_versions=list(seg.versions),
                    routed_experts=seg.routed_experts,
                    trajectory_id=group_id * 1_000 + traj_index if len(segments) > 1 else None,
                    images=item.images,
                    metadata={
                        "ground_truth": item.ground_truth,
                        "index": item.index,
                        "prompt": item.prompt,
                        "columns": item.metadata,
                        "messages": [dict(m) for m in traj.messages],
                        "answer_ids": list(traj.last_turn_ids),
                        "env_reward": traj.reward,
                        "episode": stats,
                    },
                )
            )
        return out
