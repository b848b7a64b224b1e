"""`Endpoint`: the OpenAI-compatible HTTP server (a plain ASGI app on uvicorn) in a background thread
with an event loop of its own, in the process that drives the rollout engine.

It only speaks HTTP: a request is checked (`api.parse_*`; a bad one gets the OpenAI-style 4xx body at
once), handed over as a `Call` to the thread that owns the engine (`take`), and its handler awaits
the `Answer` that thread gives back with `Call.reply` (a streaming request also the `Delta`s of
its tokens as they are sampled, `Call.send`, each sent on at once). Routes, each also under
`/sessions/<id>/v1/...` (a training session's base URL: the session's requests are its ledger's):
`GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from rlloom.agents.api import (
    Answer,
    ApiError,
    Delta,
    chat_response,
    completion_response,
    parse_chat,
    parse_completion,
    stream_events,
)

log = logging.getLogger(__name__)

INSTALL_HINT = 'the OpenAI-compatible endpoint needs uvicorn. Fix: pip install "rlloom[serve]"'


def check_installed() -> None:
    """ValueError with the one-line install hint when uvicorn is missing."""
    try:
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from e


@dataclass(frozen=True, slots=True)
class Call:
    """One generation request handed to the engine's thread."""

    session: str | None
    """The session id of its URL (None: the plain `/v1` URL)."""
    request: Any
    """The checked request (`api.GenRequest`)."""
    reply: Callable[[Answer | ApiError], None]
    """Give the answer (or an error) back to the waiting handler; callable from any thread, once."""
    send: Callable[[Delta], None]
    """Give a streaming request the tokens sampled so far (before `reply`); from any thread."""


async def _until_answer(first: Delta | Answer, events: asyncio.Queue) -> AsyncIterator[Delta | Answer]:
    """A streaming request's events up to its `Answer` (an error after the first tokens ends it)."""
    event = first
    while not isinstance(event, Answer):
        yield event
        event = await events.get()
        if isinstance(event, ApiError):
            return
    yield event


class Endpoint:
    """The HTTP server; `start()` binds it (port 0: a free port), `take()` yields its calls."""

    def __init__(self, *, model_id: str, host: str = "127.0.0.1", port: int = 0, sessions_only: bool) -> None:
        self.model_id, self.host, self.sessions_only = model_id, host, sessions_only
        self._port = port
        self._inbox: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    def session_url(self, session: str) -> str:
        """A session's OpenAI base URL."""
        return f"{self.url}/sessions/{session}/v1"

    def start(self) -> None:
        import uvicorn

        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets of that protocol, and without it
        # every answer waited for the client's delayed ACK (about 40 ms a request on Linux).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._port))
        except OSError as e:
            sock.close()
            raise ValueError(
                f"cannot listen on {self.host}:{self._port} ({e.strerror}). Fix: pick another --port"
            ) from e
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
            lifespan="off",
            proxy_headers=False,
            interface="asgi3",
        )
        self._server = uvicorn.Server(config)
        started = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()  # its own loop: the engine's thread never blocks on HTTP
            task = loop.create_task(self._server.serve(sockets=[sock]))
            loop.call_soon(lambda: self._watch(started, task))
            loop.run_until_complete(task)
            loop.close()

        self._thread = threading.Thread(target=serve, name="rlloom-endpoint", daemon=True)
        self._thread.start()
        if not started.wait(30.0):
            raise RuntimeError(f"the endpoint did not start on {self.url} within 30 s")

    def _watch(self, started: threading.Event, task: asyncio.Task) -> None:
        if self._server.started or task.done():
            started.set()
            return
        asyncio.get_running_loop().call_later(0.01, self._watch, started, task)

    def take(self, timeout_s: float = 0.0) -> list[Call]:
        """The calls that arrived (waiting up to `timeout_s` for the first)."""
        out = []
        try:
            out.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            return out

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10.0)
        self._server = self._thread = None

    async def _submit(self, session: str | None, req: Any) -> tuple[Delta | Answer, asyncio.Queue]:
        """Hand the request to the engine's thread; its first event (an `ApiError` raised) and the
        queue the rest arrive in."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Delta | Answer | ApiError] = asyncio.Queue()

        def put(event: Delta | Answer | ApiError) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        self._inbox.put(Call(session=session, request=req, reply=put, send=put))
        first = await events.get()
        if isinstance(first, ApiError):
            raise first
        return first, events

    # ---- the app: plain ASGI on uvicorn ----------------------------------------------------------

    async def _app(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        """Every HTTP request: routed by its path, errors as OpenAI bodies. Plain ASGI rather than a
        web framework: a framework's routing, middleware and dependency layers cost the trainer
        process about a millisecond of CPU (and of the engine thread's GIL) on every agent request."""
        if scope["type"] != "http":
            return
        started = False

        async def respond(status: int, body: dict[str, Any]) -> None:
            nonlocal started
            started = True
            data = json.dumps(body).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data})

        try:
            session, route = _route(scope["path"])
            if route == "models" and scope["method"] == "GET":
                await respond(200, self._models())
            elif route in ("chat/completions", "completions") and scope["method"] == "POST":
                req = _parse(await _body(receive), "chat" if route == "chat/completions" else "completion")
                if self.sessions_only and session is None:
                    raise ApiError(
                        404,
                        "this endpoint serves training sessions only: use the base URL rlloom gave the agent",
                    )
                first, events = await self._submit(session, req)
                if req.stream:
                    started = True
                    await _stream(send, stream_events(req, _until_answer(first, events), model=self.model_id))
                else:
                    build = chat_response if req.kind == "chat" else completion_response
                    await respond(200, build(req, first, model=self.model_id))
            elif route is not None:
                raise ApiError(405, f"{scope['method']} is not allowed on {scope['path']}")
            else:
                raise ApiError(
                    404,
                    "no such route; the endpoint serves /v1/models, /v1/chat/completions and /v1/completions",
                )
        except ApiError as e:
            if not started:
                await respond(e.status, e.body())
        except Exception as e:  # noqa: BLE001 - a 500 body, never a traceback to the client
            log.exception("endpoint: a request failed")
            if not started:
                await respond(500, ApiError(500, f"internal error: {type(e).__name__}: {e}").body())

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_id, "object": "model", "created": 0, "owned_by": "rlloom"}],
        }


ROUTES = ("models", "chat/completions", "completions")


def _route(path: str) -> tuple[str | None, str | None]:
    """(session id or None, route or None) of a URL path: `/v1/<route>` or `/sessions/<id>/v1/<route>`."""
    session = None
    if path.startswith("/sessions/"):
        session, _, path = path[len("/sessions/") :].partition("/")
        path = "/" + path
    route = path[len("/v1/") :].rstrip("/") if path.startswith("/v1/") else None
    return session or None, route if route in ROUTES else None


async def _body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse(body: bytes, kind: str) -> Any:
    try:
        data = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from e
    return parse_chat(data) if kind == "chat" else parse_completion(data)


async def _stream(send: Callable, lines: AsyncIterator[str]) -> None:
    """A server-sent-event response: each line sent as it comes."""
    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    async for line in lines:
        await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b""})
