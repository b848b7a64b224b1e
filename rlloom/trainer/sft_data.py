"""The rows `rlloom sft` trains on, as `Sample`s whose loss mask marks the assistant's tokens.

Rows: a conversations file (data.task=jsonl/parquet, `rlloom.data.conversations`), or the arithmetic
task's training problems with their solutions as the assistant's answer (data.task=arithmetic: the
generated data of the `arithmetic_sft` recipe; its evaluation problems are held out as in RL).
data.system_prompt goes first as in RL's prompts.

Tokens: laid out as a multi-turn trajectory lays out an episode (`rlloom.episodes.trajectory`), so
the fine-tuned model sees the token sequences that generation will show it. The prompt is the
conversation up to the first assistant message rendered with the generation prompt; each assistant
message is the text the template adds for it (`episodes/render.extension_ids` of the conversation
rendered through it), trained on up to and including its first control token, the end-of-turn
token (`<|im_end|>`; what the template writes after it, a newline, is not the model's to say); the
messages between assistant turns are the template's extension, not trained on. Where the template
rewrites earlier turns (Qwen3 drops earlier `<think>` blocks), the turn starts a new sample whose
prompt is the re-rendered conversation, as multi-turn RL splits trajectories. Messages after the
last assistant message are left out (nothing after them is trained). Control-token strings in the
data are plain text (`rlloom.data.control_tokens`), so only the template's own end-of-turn token is
trained as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlloom.config import ConfigError, DataConfig
from rlloom.data.chat import prompt_messages
from rlloom.data.control_tokens import control_tokens
from rlloom.data.conversations import Conversation, load_conversations
from rlloom.data.dataset import DataError, Message
from rlloom.data.types import Sample
from rlloom.episodes.render import Rendered, encode, extension_ids, render_conversation
from rlloom.tasks.build import task_prompts

SFT_TASKS = ("jsonl", "parquet", "arithmetic")
"""data.task values `rlloom sft` reads: conversation files, or arithmetic problems with their answers."""


def sft_conversations(data: DataConfig) -> list[Conversation]:
    """The rows to fine-tune on (checked; DataError / ConfigError name the setting or row)."""
    if data.task not in SFT_TASKS:
        raise ConfigError(
            f"data.task={data.task} is invalid for rlloom sft: its rows hold no answers to train on. Fix: set "
            "data.task=jsonl or parquet with data.path a file of chat conversations (or arithmetic)."
        )
    if not data.chat_template:
        raise ConfigError(
            "data.chat_template=false is invalid for rlloom sft: the assistant's tokens are found through the "
            "chat template. Fix: set data.chat_template=true (the tokenizer needs a chat template)."
        )
    if data.task == "arithmetic":
        return [
            Conversation(
                messages=[{"role": "user", "content": str(raw.prompt)}]
                + [{"role": "assistant", "content": raw.ground_truth}],
                line=raw.index + 1,
            )
            for raw in task_prompts(data, "train")
        ]
    return load_conversations(data.path, messages_key=data.messages_key, file_format=data.task)


@dataclass(slots=True)
class _Segment:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

    def add(self, ids: list[int], num_trained: int) -> None:
        self.response_ids += ids
        self.loss_mask += [1] * num_trained + [0] * (len(ids) - num_trained)

    def sample(self, group_id: int, line: int) -> Sample:
        trained = len(self.loss_mask) - self.loss_mask[::-1].index(1)  # nothing after the last trained token
        return Sample(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids[:trained],
            loss_mask=self.loss_mask[:trained],
            group_id=group_id,
            metadata={"line": line},
        )


def conversation_samples(
    tokenizer: Any, conversation: Conversation, *, system_prompt: str, group_id: int
) -> list[Sample]:
    """The conversation's tokens with the assistant's marked (see the module docstring): one sample,
    or one per run of turns the template renders as an extension of the one before."""
    messages: list[Message] = prompt_messages(conversation.messages, system_prompt)
    control_ids = set(control_tokens(tokenizer).values())

    def render(upto: int, generation_prompt: bool) -> Rendered:  # the first `upto` messages
        return render_conversation(
            tokenizer, messages[:upto], tools=None, add_generation_prompt=generation_prompt
        )

    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    segments = [_Segment(prompt_ids=encode(tokenizer, render(assistant_at[0], True)))]
    for k, at in enumerate(assistant_at):
        so_far = segments[-1].prompt_ids + segments[-1].response_ids
        if k > 0:  # the messages since the last answer and the generation prompt: context, not trained
            context = extension_ids(tokenizer, so_far, render(at, True))
            if context is None:  # the template rewrote earlier turns: a new sample from here
                segments.append(_Segment(prompt_ids=encode(tokenizer, render(at, True))))
            else:
                segments[-1].add(context, 0)
            so_far = segments[-1].prompt_ids + segments[-1].response_ids
        answer = extension_ids(tokenizer, so_far, render(at + 1, False))
        if answer is None:
            raise DataError(
                f"line {conversation.line}: the chat template renders the conversation up to message {at} (an "
                "assistant message) differently from its generation prompt, so the answer's tokens cannot be told "
                "apart. Fix: use a model whose template appends the answer after `add_generation_prompt`."
            )
        ends = [i for i, t in enumerate(answer) if t in control_ids]
        segments[-1].add(answer, ends[0] + 1 if ends else len(answer))  # through the end-of-turn token
    return [s.sample(group_id, conversation.line) for s in segments if 1 in s.loss_mask]
