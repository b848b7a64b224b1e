"""`Endpoint`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) in a background thread with an
event loop of its own, in the process that drives the rollout engine.

It only speaks HTTP: a request is checked (`api.parse_*`; a bad one gets the OpenAI-style 4xx body at
once), handed over as a `Call` to the thread that owns the engine (`take`), and its handler awaits
the `Answer` that thread gives back with `Call.reply` (a streaming request also the `Delta`s of
its tokens as they are sampled, `Call.send`, each sent on at once). Routes, each also under
`/sessions/<id>/v1/...` (a training session's base URL: the session's requests are its ledger's):
`GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (`Request`, imported
# in `_app` only, as the server's packages are optional) as objects.
import asyncio
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

INSTALL_HINT = 'the OpenAI-compatible endpoint needs FastAPI and uvicorn. Fix: pip install "rlloom[serve]"'


def check_installed() -> None:
    """ValueError with the one-line install hint when FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
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
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, timeout_keep_alive=30)
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

    # ---- the app -------------------------------------------------------------------------------

    def _app(self) -> Any:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="rlloom", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(_: Request, e: ApiError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(HTTPException)
        async def http_error(_: Request, e: HTTPException) -> JSONResponse:
            message = (
                "no such route; the endpoint serves /v1/models, /v1/chat/completions and /v1/completions"
            )
            return JSONResponse(
                ApiError(e.status_code, message if e.status_code == 404 else str(e.detail)).body(),
                e.status_code,
            )

        @app.exception_handler(Exception)
        async def server_error(_: Request, e: Exception) -> JSONResponse:
            log.exception("endpoint: a request failed")
            return JSONResponse(
                ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500
            )

        def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{"id": self.model_id, "object": "model", "created": 0, "owned_by": "rlloom"}],
            }

        async def generate(request: Request, session: str | None, kind: str) -> Any:
            try:
                body = await request.json()
            except ValueError as e:
                raise ApiError(400, f"the request body is not valid JSON ({e})") from e
            req = parse_chat(body) if kind == "chat" else parse_completion(body)
            if self.sessions_only and session is None:
                raise ApiError(
                    404, "this endpoint serves training sessions only: use the base URL rlloom gave the agent"
                )
            first, events = await self._submit(session, req)
            if req.stream:
                return StreamingResponse(
                    stream_events(req, _until_answer(first, events), model=self.model_id),
                    media_type="text/event-stream",
                )
            build = chat_response if kind == "chat" else completion_response
            return JSONResponse(build(req, first, model=self.model_id))

        for prefix in ("/v1", "/sessions/{session}/v1"):
            app.get(f"{prefix}/models")(lambda session=None: models())

            @app.post(f"{prefix}/chat/completions")
            async def chat(request: Request, session: str | None = None) -> Any:
                return await generate(request, session, "chat")

            @app.post(f"{prefix}/completions")
            async def completions(request: Request, session: str | None = None) -> Any:
                return await generate(request, session, "completion")

        return app
