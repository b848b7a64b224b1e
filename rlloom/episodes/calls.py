"""Environment calls off the controller's thread: `EnvSpec` (what builds a trajectory's environment:
`rollout.env`, or the built-in `ToolEnv` for `rollout.tools`), `call_env` (one `reset`/`step` call,
awaited when `async def`, its result checked) and `EnvCalls`, the pool that runs them.

Isolated (`rollout.env_workers >= 1`, the default): calls run in worker processes (episodes/worker.py)
with a deadline of `rollout.env_timeout_s`; a worker that misses it, or dies (a crash, `os._exit`),
is killed with every process it started and replaced, and only that call fails. Inline
(`env_workers: 0`): calls run in threads of this process, for cheap trusted environments; a call past
its deadline fails the trajectory, and its thread is left to finish on its own.
A failed call ends its trajectory (reward.default_score, counted in `rollout/env_errors`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pickle
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from rlloom.data.dataset import PromptItem
from rlloom.episodes.tools import ToolEnv, tool_schema
from rlloom.episodes.types import as_env_step, check_messages
from rlloom.rewards.process import WorkerProcess

WORKER_ENTRY = "from rlloom.episodes.worker import main; main()"
"""What an environment worker process runs (episodes/worker.py)."""
_POLL_S = 0.05
_STARTUP_TIMEOUT_S = 120.0


def import_object(path: str, *, setting: str, import_dir: str) -> Any:
    """The object at "module:attr" (a module next to the YAML config, in `import_dir`, imports
    without PYTHONPATH); ValueError naming `setting` when it cannot be found."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{setting}={path!r} is not 'module:name'; fix: write e.g. 'my_env:MyEnv'")
    if import_dir and import_dir not in sys.path:
        sys.path.append(import_dir)  # appended: a file next to the config never shadows an installed module
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module
        raise ValueError(
            f"{setting}={path!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}); fix: put "
            f"{module_name}.py next to the YAML config (or in reward.import_dir), or add its folder to PYTHONPATH"
        ) from e
    if not hasattr(module, attr):
        raise ValueError(f"{setting}={path!r}: module {module_name!r} has no {attr!r}; fix: check the name")
    return getattr(module, attr)


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """How to build one trajectory's environment (picklable: worker processes build from it)."""

    env: str = ""
    """`rollout.env` ("module:Class"), or empty for the built-in tool environment."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: tuple[str, ...] = ()
    tool_parser: str = "hermes"
    tool_timeout_s: float = 10.0
    import_dir: str = ""

    def tool_functions(self) -> dict[str, Callable[..., Any]]:
        fns = [import_object(t, setting="rollout.tools", import_dir=self.import_dir) for t in self.tools]
        return {fn.__name__: fn for fn in fns}

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(fn) for fn in self.tool_functions().values()]

    @property
    def what(self) -> str:
        """What the workers run, for messages."""
        return self.env or "the tools"

    def preload(self) -> None:
        """Import the environment and the tools (a worker does so before it says it is ready)."""
        self.tool_functions()
        if self.env:
            import_object(self.env, setting="rollout.env", import_dir=self.import_dir)

    def build(self) -> Any:
        if not self.env:
            return ToolEnv(self.tool_functions(), parser=self.tool_parser, timeout_s=self.tool_timeout_s)
        cls = import_object(self.env, setting="rollout.env", import_dir=self.import_dir)
        return cls(**self.env_kwargs)

    def check(self) -> None:
        """Start-up check before the model loads: everything imports, the tools have schemas, the
        environment class builds and has `step` (ValueError naming the setting otherwise)."""
        for name, fn in self.tool_functions().items():
            if not callable(fn):
                raise ValueError(f"rollout.tools: {name!r} is not a function; fix: name a function")
            try:
                tool_schema(fn)
            except ValueError as e:
                raise ValueError(f"rollout.tools: {e}") from e
        if not self.env:
            return
        cls = import_object(self.env, setting="rollout.env", import_dir=self.import_dir)
        if not inspect.isclass(cls):
            raise ValueError(f"rollout.env={self.env!r} is not a class; fix: name a class with reset/step")
        for method, params in (("step", 2), ("reset", 1)):
            fn = getattr(cls, method, None)
            if fn is None and method == "reset":
                continue  # optional: the row's prompt is the first message
            if not callable(fn):
                raise ValueError(f"rollout.env={self.env!r} has no method {method!r}; fix: define {method}()")
            try:
                inspect.signature(fn).bind(None, *([None] * params))
            except TypeError as e:
                want = "step(self, messages, state)" if method == "step" else "reset(self, row)"
                raise ValueError(
                    f"rollout.env={self.env!r}: {method} has the wrong signature ({e}); fix: define {want}"
                ) from e
        try:
            inspect.signature(cls).bind(**self.env_kwargs)
        except TypeError as e:
            raise ValueError(
                f"rollout.env_kwargs={self.env_kwargs!r} do not fit {self.env}'s constructor ({e}); fix: "
                "pass the arguments its __init__ takes"
            ) from e

    def call(self, env: Any, state: dict[str, Any], method: str, arg: Any) -> Any:
        """One call on a built environment (what a worker runs for each task)."""
        return call_env(env, state, method, arg)


def call_env(env: Any, state: dict[str, Any], method: str, arg: Any) -> Any:
    """`env.reset(arg)` or `env.step(arg, state)` (awaited when `async def`), its result checked:
    `reset` -> a list of chat messages or None; `step` -> an `EnvStep`."""
    fn = getattr(env, method, None)
    if fn is None and method == "reset":
        return None
    value = fn(arg) if method == "reset" else fn(arg, state)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    if method == "reset":
        if value is None:
            return None
        return check_messages(value, "reset() result", roles=("system", "user", "assistant", "tool"))
    return as_env_step(value)


async def _await(value: Any) -> Any:
    return await value


@dataclass(kw_only=True, slots=True)
class EnvResult:
    """One finished call: its key, the checked value (or the error) and the environment after it."""

    key: Any
    value: Any = None
    env: Any = None
    """The trajectory's environment handle after the call (pass it to the next `submit`)."""
    error: str | None = None


@dataclass(kw_only=True, slots=True)
class _Task:
    key: Any
    env: Any
    """The environment handle: None for a new one, else (environment, state) inline, or their
    pickled bytes when isolated."""
    method: str
    arg: Any


class EnvCalls:
    """Runs environment calls isolated (worker processes) or inline (threads); `submit` then `poll`.
    `spec` is an `EnvSpec`, or any picklable record with its `what`, `preload()`, `build()` and
    `call(...)` (an agent's, agents/spec.py)."""

    def __init__(self, spec: Any, *, num_workers: int, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.isolated = num_workers > 0
        self._pending: deque[_Task] = deque()
        self._running: dict[Any, tuple[_Task, float, Future | None]] = {}
        self._done: list[EnvResult] = []
        self._next_id = 0
        if self.isolated:
            self._payload = pickle.dumps(spec)
            self._workers = [self._start() for _ in range(num_workers)]
            self._busy: list[tuple[int, _Task] | None] = [None] * num_workers
        else:
            self._threads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="env")

    @property
    def num_in_flight(self) -> int:
        return len(self._pending) + len(self._running)

    def queued(self) -> set[Any]:
        """The keys of the calls waiting for a free worker (not started)."""
        return {task.key for task in self._pending}

    def submit(self, key: Any, env: Any, method: str, arg: Any) -> None:
        """Run `method` ("reset" with the row, "step" with the messages) on the environment handle
        `env` (None: a new environment); its `EnvResult` comes out of a later `poll` under `key`."""
        self._pending.append(_Task(key=key, env=env, method=method, arg=arg))
        self._dispatch()

    def poll(self, timeout_s: float) -> list[EnvResult]:
        """The calls finished since the last poll (waiting up to `timeout_s` for one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._dispatch()
            self._collect(max(0.0, min(_POLL_S, deadline - time.monotonic())))
            self._expire()
            if self._done or time.monotonic() >= deadline or not self.num_in_flight:
                out, self._done = self._done, []
                return out

    def close(self) -> None:
        if self.isolated:
            for w in self._workers:
                w.kill()
            self._workers = []
        else:
            self._threads.shutdown(wait=False, cancel_futures=True)

    # ---- inline ---------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while self._pending:
            if not self.isolated:
                task = self._pending.popleft()
                future = self._threads.submit(self._inline_call, task)
                self._running[id(task)] = (task, time.monotonic() + self.timeout_s, future)
                continue
            free = [k for k, b in enumerate(self._busy) if b is None and self._workers[k].ready]
            if not free:
                return
            task = self._pending.popleft()
            self._send(free[0], task)

    def _inline_call(self, task: _Task) -> EnvResult:
        try:
            env, state = (self.spec.build(), {}) if task.env is None else task.env
            return EnvResult(
                key=task.key, value=self.spec.call(env, state, task.method, task.arg), env=(env, state)
            )
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the trajectory fails, the run goes on
            return EnvResult(key=task.key, error=f"{type(e).__name__}: {e}"[:1000])

    def _collect(self, timeout_s: float) -> None:
        if not self.isolated:
            futures = [f for _, _, f in self._running.values()]
            if futures and not any(f.done() for f in futures):
                time.sleep(timeout_s)
            for tid, (_, _, future) in list(self._running.items()):
                if future.done():
                    del self._running[tid]
                    self._done.append(future.result())
            return
        by_conn = {w.conn: k for k, w in enumerate(self._workers)}
        for conn in wait(list(by_conn), timeout=timeout_s):
            k = by_conn[conn]
            try:
                while conn.poll():
                    self._on_message(k, conn.recv())
            except (EOFError, OSError):
                self._fail(k, "the environment worker process died")

    def _expire(self) -> None:
        now = time.monotonic()
        if not self.isolated:
            for tid, (task, deadline, future) in list(self._running.items()):
                if now >= deadline:
                    del self._running[tid]
                    future.cancel()
                    self._done.append(EnvResult(key=task.key, error=f"no result within {self.timeout_s:g} s"))
            return
        for k, busy in enumerate(self._busy):
            if busy is not None and now >= self._running[busy[0]][1]:
                self._fail(k, f"no result within {self.timeout_s:g} s")
            elif not self._workers[k].ready and now - self._workers[k].started_at > _STARTUP_TIMEOUT_S:
                raise RuntimeError(f"an environment worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")

    # ---- isolated -------------------------------------------------------------------------------

    def _start(self) -> WorkerProcess:
        return WorkerProcess.start(self._payload, memory_limit_bytes=0, entry=WORKER_ENTRY)

    def _send(self, k: int, task: _Task) -> None:
        task_id, self._next_id = self._next_id, self._next_id + 1
        self._busy[k] = (task_id, task)
        self._running[task_id] = (task, time.monotonic() + self.timeout_s, None)
        try:
            self._workers[k].conn.send((task_id, task.env, task.method, task.arg))
        except (OSError, ValueError):
            self._fail(k, "the environment worker process died")

    def _on_message(self, k: int, message: Any) -> None:
        if isinstance(message, tuple) and message[0] == "ready":
            self._workers[k].ready = True
            return
        if isinstance(message, tuple) and message[0] == "load_error":
            raise RuntimeError(f"an environment worker cannot load {self.spec.what}: {message[1]}")
        for task_id, kind, payload in message:
            busy = self._busy[k]
            if busy is None or busy[0] != task_id:
                continue
            task = busy[1]
            self._busy[k] = None
            del self._running[task_id]
            if kind == "ok":
                value, env = payload
                self._done.append(EnvResult(key=task.key, value=value, env=env))
            else:
                self._done.append(EnvResult(key=task.key, error=payload))

    def _fail(self, k: int, why: str) -> None:
        """Kill and replace worker k; the call it ran (if any) fails with `why`."""
        busy = self._busy[k]
        if busy is not None:
            self._running.pop(busy[0], None)
            self._done.append(EnvResult(key=busy[1].key, error=why))
        self._busy[k] = None
        self._workers[k].kill()
        self._workers[k] = self._start()


def prompt_row(item: PromptItem) -> dict[str, Any]:
    """The data row an environment's `reset` (or an agent) receives: the prompt, its ground truth
    and the row's other columns."""
    return {"prompt": item.prompt, "ground_truth": item.ground_truth, **item.metadata}


@dataclass(slots=True)
class GroupCalls:
    """A driver's view of the pool (the episode and the agent drivers share it): one call at a time
    per trajectory `j` of a prompt group `key`, under the current epoch. `forget` starts a new
    epoch, and the calls of the dropped groups still in flight never come out of `poll`."""

    calls: EnvCalls
    epoch: int = 0

    def submit(self, key: Any, j: int, env: Any, method: str, arg: Any) -> None:
        self.calls.submit((self.epoch, key, j), env, method, arg)

    def poll(self, timeout_s: float) -> list[tuple[Any, int, EnvResult]]:
        """(group key, trajectory, result) of this epoch's calls finished since the last poll."""
        out = []
        for result in self.calls.poll(timeout_s):
            epoch, key, j = result.key
            if epoch == self.epoch:
                out.append((key, j, result))
        return out

    @property
    def waiting(self) -> bool:
        """Calls are in flight."""
        return self.calls.num_in_flight > 0

    def queued(self) -> set[tuple[Any, int]]:
        """(group key, trajectory) of this epoch's calls not started yet (no worker was free)."""
        return {(key, j) for epoch, key, j in self.calls.queued() if epoch == self.epoch}

    def forget(self) -> None:
        self.epoch += 1

    def close(self) -> None:
        self.calls.close()
