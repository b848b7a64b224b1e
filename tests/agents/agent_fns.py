"""Agents the endpoint tests load by "module:function" (this folder is their import_dir)."""

from __future__ import annotations

import os
import sys
import time

from openai import AsyncOpenAI


async def two_turns(base_url, row, sampling):
    """Two chat turns with a tool message between them, through the official client."""
    async with AsyncOpenAI(base_url=base_url, api_key="none") as client:
        messages = [{"role": "user", "content": row["prompt"]}]
        first = await client.chat.completions.create(messages=messages, **sampling)
        messages.append({"role": "assistant", "content": first.choices[0].message.content})
        messages.append({"role": "tool", "content": "42"})
        await client.chat.completions.create(messages=messages, **sampling)
    return None


async def tool_then_done(base_url, row, sampling):
    """`ToolThenDone` as an agent: a second turn after the tool message "42" unless the first turn
    ended by length (the environment driver ends such a trajectory)."""
    async with AsyncOpenAI(base_url=base_url, api_key="none") as client:
        messages = [{"role": "user", "content": row["prompt"]}]
        first = await client.chat.completions.create(messages=messages, **sampling)
        if first.choices[0].finish_reason == "length":
            return None
        messages.append({"role": "assistant", "content": first.choices[0].message.content})
        messages.append({"role": "tool", "content": "42"})
        await client.chat.completions.create(messages=messages, **sampling)
    return None


class ToolThenDone:
    """An environment (`rollout.env`): the tool message "42" after the first turn, then done."""

    def step(self, messages, state):
        if any(m["role"] == "tool" for m in messages):
            return {"done": True}
        return {"observations": [{"role": "tool", "content": "42"}]}


async def streamed_then_whole(base_url, row, sampling):
    """Two chat turns, the first streamed (its content chunks counted: metric `chunks`)."""
    async with AsyncOpenAI(base_url=base_url, api_key="none") as client:
        messages = [{"role": "user", "content": row["prompt"]}]
        chunks = []
        async for c in await client.chat.completions.create(messages=messages, stream=True, **sampling):
            if c.choices and c.choices[0].delta.content:
                chunks.append(c.choices[0].delta.content)
        messages.append({"role": "assistant", "content": "".join(chunks)})
        messages.append({"role": "tool", "content": "42"})
        await client.chat.completions.create(messages=messages, **sampling)
    return {"metrics": {"chunks": float(len(chunks))}}


async def streamed_turns(base_url, row, sampling):
    """Two chat turns, both streamed, with a tool message between them."""
    async with AsyncOpenAI(base_url=base_url, api_key="none") as client:
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(2):
            stream = await client.chat.completions.create(messages=messages, stream=True, **sampling)
            content = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": "42"}]
    return None


async def faulty(base_url, row, sampling):
    """Fails as the row's prompt ends: hang, exit, crash, raise, garbage, or fine (reward 1)."""
    async with AsyncOpenAI(base_url=base_url, api_key="none") as client:
        await client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **sampling)
    how = row["ground_truth"]
    if how == "hang":
        time.sleep(1000)
    if how == "exit":
        sys.exit(3)
    if how == "crash":
        os._exit(1)
    if how == "raise":
        raise RuntimeError("the agent broke")
    if how == "garbage":
        return "not a reward"
    return {"reward": 1.0, "metrics": {"calls": 1.0}}


def one_argument(base_url):
    """The wrong shape: an agent takes (base_url, row, sampling)."""


async def two_turns_killing(base_url, row, sampling):
    """`two_turns` with its second turn streamed; with KILL_ACTOR_DIR=RUN_DIR set, the first session
    whose second turn is being sampled after step 1 is logged sends SIGKILL to the rollout actor
    (rank 0 of RUN_DIR/actors.json) at that turn's first chunk, its request in flight on the replica;
    RUN_DIR/killed-rollout-0 holds the kill's time.time() and pid, and each session appends its
    messages and the second answer it read to RUN_DIR/read.jsonl."""
    async with AsyncOpenAI(base_url=base_url, api_key="none") as client:
        messages = [{"role": "user", "content": row["prompt"]}]
        first = await client.chat.completions.create(messages=messages, **sampling)
        messages.append({"role": "assistant", "content": first.choices[0].message.content})
        messages.append({"role": "tool", "content": "42"})
        read = []
        async for c in await client.chat.completions.create(messages=messages, stream=True, **sampling):
            _kill_rollout_once()
            read += [c.choices[0].delta.content or ""] if c.choices else []
    _log_read(messages, "".join(read))
    return None


def _log_read(messages: list[dict], answer: str) -> None:
    import json
    from pathlib import Path

    line = json.dumps({"asked": [m["content"] for m in messages], "read": answer}) + "\n"
    run_dir = Path(os.environ.get("KILL_ACTOR_DIR", "/nonexistent"))
    if run_dir.is_dir():
        fd = os.open(run_dir / "read.jsonl", os.O_CREAT | os.O_APPEND | os.O_WRONLY)
        os.write(fd, line.encode())
        os.close(fd)


def _kill_rollout_once() -> None:
    import json
    import signal
    from pathlib import Path

    run_dir = Path(os.environ.get("KILL_ACTOR_DIR", "/nonexistent"))
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists() or not any(json.loads(x)["step"] == 1 for x in metrics.read_text().splitlines()):
        return
    try:
        marker = os.open(run_dir / "killed-rollout-0", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # another session killed it
    actors = json.loads((run_dir / "actors.json").read_text())
    pid = next(a["pid"] for a in actors if a["role"] == "rollout" and a["rank"] == 0)
    os.write(marker, f"{time.time()} {pid}\n".encode())
    os.close(marker)
    os.kill(pid, signal.SIGKILL)
