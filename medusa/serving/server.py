"""An OpenAI-compatible HTTP server over a :class:`~medusa.serving.scheduler.Scheduler`.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health``. Every request's tokens come from the
one scheduler thread that owns the engine, batched with whatever else runs, and are the tokens
the request gets alone (docs/exactness.md#batches). ``usage`` carries ``tokens_per_pass`` (tau).

Errors follow OpenAI's shape (``{"error": {"message", "type", "code"}}``): 400 for a bad request
(one line naming the field: :mod:`medusa.serving.schema` checks a request whole, and refuses by
name every field this server does not implement), 401 without the ``--api-key``, 403 for a
foreign ``Host``/``Origin`` when no key is set, 413 for a body over ``max_body`` bytes, 415 for a
POST that is not JSON, 429 when the queue is full, 503 while shutting down. Everything that can
fail for one request (validation, tokenizing, seeding) fails before it joins the batch, off the
event loop; a request whose own step fails ends alone. A client that disconnects cancels its
request: the slot frees at the next step. ``stop`` strings end an answer where they start, across
chunk boundaries (:mod:`medusa.serving.stops`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from medusa.decoding.engine import Engine
from medusa.decoding.generation import read
from medusa.decoding.request import make_request
from medusa.decoding.text import TextStream
from medusa.errors import MedusaError
from medusa.serving.metrics import Metrics
from medusa.serving.scheduler import PREFILL_ROWS, Closed, Overloaded, Scheduler, Stream
from medusa.serving.schema import BadRequest, ChatRequest, CompletionRequest, Unsupported, parse_body, validate
from medusa.serving.stops import StopStrings

log = logging.getLogger("medusa.serving")

FINISH = {"eos": "stop", "length": "length", "context": "length", "stopped": "stop"}
MAX_BODY = 4 * 2**20  # bytes: a request of this size holds about a million tokens of text
LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")

__all__ = ["BadRequest", "Unsupported", "Server", "create_app", "loopback_hosts"]


def loopback_hosts(host: str, port: int) -> tuple[str, ...] | None:
    """The ``Host`` header values a server bound to ``host``:``port`` answers without a key: its
    loopback names with the port (bare too on port 80); None for a bind beyond loopback, which
    is meant to be reached by other names (and should have a key)."""
    if host not in LOOPBACK:
        return None
    names = ("127.0.0.1", "localhost", "[::1]")
    return tuple(f"{n}:{port}" for n in names) + (names if port == 80 else ())


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


class Server:
    """The app's state: the engine, its scheduler, the served model's name and the key."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None, max_batch: int = 8,
                 max_queue: int = 64, default_max_tokens: int = 256, mode: str | None = None,
                 max_body: int = MAX_BODY, hosts: tuple[str, ...] | None = None, kv_memory: int | None = None,
                 prefix_memory: int | None = None, prefill_rows: int = PREFILL_ROWS) -> None:
        if engine.tokenizer is None:
            raise MedusaError("the server needs the engine's tokenizer: load it with medusa.load")
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.default_max_tokens, self.mode, self.max_body = default_max_tokens, mode, max_body
        # the Host header values served without a key (None: any): a page in the user's browser
        # must not reach a server on 127.0.0.1 by naming another host (DNS rebinding)
        self.hosts = hosts
        self.metrics = Metrics(model_name)
        self.scheduler = Scheduler(engine, max_batch=max_batch, max_queue=max_queue, metrics=self.metrics,
                                   kv_memory=kv_memory, prefix_memory=prefix_memory, prefill_rows=prefill_rows)
        self.vocab = engine.model.get_input_embeddings().num_embeddings
        self.created = int(time.time())

    # -- requests -> scheduler arguments -------------------------------------------------
    def prepare(self, body: dict, chat: bool) -> tuple[ChatRequest | CompletionRequest, list[int]]:
        """The request checked whole and its prompt's token ids (a :class:`BadRequest` naming
        the field otherwise). Tokenizing a long prompt takes a while: the server calls this in a
        worker thread, not on the event loop."""
        request = validate(body, chat)
        request.wants_logprobs()  # its own checks (top_logprobs without logprobs)
        request.penalties(self.vocab)  # and logit_bias's token ids
        if request.model is not None and request.model != self.model_name:
            raise BadRequest(f"unknown model {request.model!r}: this server serves {self.model_name!r} (GET /v1/models)")
        ids = self.chat_prompt(request) if chat else self.text_prompt(request)
        return request, ids

    def chat_prompt(self, request: ChatRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest(f"{self.model_name} has no chat template: use /v1/completions with a prompt")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in request.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def text_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.one_prompt()
        if isinstance(prompt, str):
            return list(self.engine.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if any(not 0 <= t < self.vocab for t in prompt):
            raise BadRequest(f"prompt: token ids must be in [0, {self.vocab}) for {self.model_name}")
        return list(prompt)

    def _max_tokens(self, request: ChatRequest | CompletionRequest, prompt: int) -> int:
        """The request's token limit; one left unset is the server's default, lowered to what the
        model's context has left after the prompt (as vLLM does)."""
        window = self.engine.max_positions
        key = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        asked = request.max_completion_tokens or request.max_tokens
        if asked is None:
            if window is not None and prompt >= window:
                raise BadRequest(f"the prompt has {prompt} tokens: the model's context holds {window}; shorten it")
            return self.default_max_tokens if window is None else min(self.default_max_tokens, window - prompt)
        if window is not None and prompt + asked > window:
            raise BadRequest(f"the prompt has {prompt} tokens and {key} is {asked}: together over the model's context "
                             f"of {window} tokens; lower {key} or shorten the prompt")
        return asked

    def submit(self, ids: list[int], request: ChatRequest | CompletionRequest, listener) -> Stream:
        n = self._max_tokens(request, len(ids))
        asked = make_request(ids, max_new_tokens=n, mode=self.mode, max_draft=request.max_draft_tokens,
                             logprobs=request.wants_logprobs(), penalties=request.penalties(self.vocab),
                             ignore_eos=bool(request.ignore_eos), **request.sampling())
        return self.scheduler.submit(asked, listener=listener)

    def usage(self, prompt: int, stream: Stream) -> dict:
        """OpenAI's usage, with the request's speculation: ``tokens_per_pass`` (tau), ``passes``
        (target passes after the prefill) and how many steps kept a drafted token at each position."""
        result = stream.result
        done = 0 if result is None else len(result.tokens)
        tau = 0.0 if result is None or not result.stats.steps else result.stats.tau
        kept = [] if result is None else [n - 1 for n in result.stats.accepted]  # all but each step's last token
        deepest = max(kept, default=0)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "tokens_per_pass": round(tau, 3), "passes": 0 if result is None else result.stats.steps,
                "accepted_by_position": [sum(1 for k in kept if k >= i) for i in range(1, deepest + 1)]}


class TooLarge(MedusaError):
    """A body over the server's ``max_body`` (413)."""


async def _read(server: Server, request: Request) -> dict:
    """The JSON body, read up to ``max_body`` bytes (a larger one is refused as it arrives)."""
    declared = request.headers.get("content-length")
    limit = server.max_body
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body has {int(declared)} bytes: this server takes at most {limit} "
                       "(serve with a larger --max-body)")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise TooLarge(f"the request body is over {limit} bytes: this server takes at most {limit} "
                           "(serve with a larger --max-body)")
    return parse_body(bytes(raw))


def _foreign(server: Server, request: Request) -> str | None:
    """Why a request without a key comes from somewhere it should not (None: it does not): a
    ``Host`` the server is not bound as, or an ``Origin`` of another site."""
    if server.api_key is not None or server.hosts is None:
        return None
    host = request.headers.get("host", "")
    if host not in server.hosts:
        return f"Host {host!r} is not this server's address"
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1] not in server.hosts:
        return f"Origin {origin!r} is another site"
    return None


def _refusal(server: Server, request: Request) -> JSONResponse | None:
    """The answer to a request this server does not take from where or how it came (None: it takes it)."""
    if (why := _foreign(server, request)) is not None:
        return error(403, f"{why}: without an API key this server answers only its own address "
                          "(serve with --api-key to take requests from elsewhere)", "permission_error",
                     "foreign_origin")
    if request.method == "POST" and request.url.path.startswith("/v1/"):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            return error(415, f"the request body must be JSON sent as Content-Type: application/json, not "
                              f"{kind or 'none'!r}", code="unsupported_media_type")
    if server.api_key is not None and request.url.path.startswith("/v1/"):
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
            return error(401, "missing or wrong API key: send Authorization: Bearer KEY", "authentication_error",
                         "invalid_api_key")
    return None


class Authorize:
    """:func:`_refusal` as plain ASGI middleware: a request taken goes to the app untouched, so a
    streamed answer's chunks reach the socket without passing through a middleware's own stream
    (Starlette's ``BaseHTTPMiddleware`` relays every chunk through a memory channel and a task
    switch: CPU a small machine takes from decoding)."""

    def __init__(self, app, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (refused := _refusal(self.server, Request(scope))) is not None:
            await refused(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(server: Server, run_scheduler: bool = True) -> FastAPI:
    """The ASGI app; its lifespan starts the scheduler on a thread of its own (unless
    ``run_scheduler`` is false: the caller runs its loop, medusa/serving/process.py) and, at
    shutdown, lets running streams finish before the scheduler stops."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if run_scheduler:
            server.scheduler.start()
        yield
        await asyncio.to_thread(server.scheduler.close)

    app = FastAPI(title="medusa", lifespan=lifespan)

    app.add_middleware(Authorize, server=server)

    @app.get("/metrics")
    async def metrics():
        load = server.scheduler.load()  # the queue's gauges as of this scrape
        server.metrics.queue(load["waiting"], load["prefilling"] + load["running"])
        body, kind = server.metrics.render()
        return Response(body, media_type=kind)

    @app.get("/health")
    async def health():
        return {"status": "ok", **server.scheduler.load()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "medusa"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(server, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(server, request, chat=False)

    return app


async def _complete(server: Server, request: Request, chat: bool):
    """One completion request: checked whole and tokenized off the event loop, queued, then
    streamed as events or answered whole."""
    try:
        body = await _read(server, request)
        checked, ids = await asyncio.to_thread(server.prepare, body, chat)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        # the scheduler thread hands each event to this loop as it is queued
        stream = server.submit(ids, checked, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    except TooLarge as exc:
        return error(413, str(exc), code="body_too_large")
    except Overloaded as exc:
        return error(429, str(exc), "rate_limit_error", "queue_full")
    except Closed as exc:
        return error(503, str(exc), "server_error", "shutting_down")
    except Unsupported as exc:
        return error(400, str(exc), code="unsupported_field")
    except MedusaError as exc:
        return error(400, str(exc))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    text = Text(server.engine.tokenizer, checked.stops(), checked.wants_logprobs(), chat)
    if checked.stream:
        usage_chunk = checked.stream_options is not None and checked.stream_options.include_usage
        return StreamingResponse(_sse(server, stream, events, text, rid, chat, len(ids), usage_chunk),
                                 media_type="text/event-stream")
    content = await _collect(stream, events, text, request)
    if not isinstance(content, str):
        return content  # an error response
    reason = text.finish(stream)
    choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": text.take_logprobs(),
               "finish_reason": reason}
              if chat else {"index": 0, "text": content, "logprobs": text.take_logprobs(), "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": [choice], "usage": server.usage(len(ids), stream)}


class Text:
    """A request's answer as text: token ids decoded as they arrive, cut at the first stop string;
    with ``logprobs`` (alternatives per token, or None), the tokens' log-probabilities in
    OpenAI's chat or completions shape, handed out with the text they belong to."""

    def __init__(self, tokenizer, stops: list[str], logprobs: int | None = None, chat: bool = True) -> None:
        self.tokenizer, self.decoder, self.stops = tokenizer, TextStream(tokenizer), StopStrings(stops)
        self.logprobs, self.chat = logprobs, chat
        self.seen, self.pending, self.offset = 0, [], 0

    def push(self, ids: list[int], stream: Stream) -> str:
        if self.stops.matched:
            return ""  # tokens decoded after the stop string, before the cancel took effect
        if self.logprobs is not None:
            self.pending += stream.run.logprobs[self.seen: self.seen + len(ids)]
            self.seen += len(ids)
        piece = self.stops.push(self.decoder.push(ids))
        if self.stops.matched:
            stream.cancel()  # the answer ends here: the slot frees at the next step
        return piece

    def take_logprobs(self) -> dict | None:
        """The pending tokens' log-probabilities as a choice's ``logprobs`` (None unless asked for)."""
        if self.logprobs is None:
            return None
        entries, self.pending = self.pending, []
        word = self._word
        if self.chat:
            return {"content": [{**word(e.token, e.logprob),
                                 "top_logprobs": [word(t, lp) for t, lp in e.top]} for e in entries]}
        tokens = [self.tokenizer.decode([e.token]) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.tokenizer.decode([t]): lp for t, lp in e.top} for e in entries]
                if self.logprobs else None, "text_offset": offsets}

    def _word(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def flush(self) -> str:
        return self.stops.push(self.decoder.flush()) + self.stops.flush()

    def finish(self, stream: Stream) -> str:
        return "stop" if self.stops.matched else FINISH.get(stream.result.finish_reason, "stop")


async def _collect(stream: Stream, events: asyncio.Queue, text: Text, request: Request):
    """A non-streamed answer's text, whole (or the error response that ended it); a client that
    goes away cancels the stream."""
    parts = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    stream.cancel()
                    return error(499, "the client went away")
                continue
            try:
                ids = read(event, stream)
            except Exception as exc:  # noqa: BLE001 - the request failed: its error answers it
                return error(500, str(exc), "server_error")
            if ids is None:
                break
            parts.append(text.push(ids, stream))
    except asyncio.CancelledError:
        stream.cancel()
        raise
    parts.append(text.flush())
    return "".join(parts)


async def _sse(server: Server, stream: Stream, events: asyncio.Queue, text: Text, rid: str, chat: bool,
               prompt: int, usage_chunk: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per accepted step, the finish reason, [DONE]."""
    created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, reason: str | None, first: bool = False) -> str:
        logprobs = None if first else text.take_logprobs()  # the tokens this piece's text came from
        if chat:
            delta = {"role": "assistant", "content": piece or ""} if first else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": logprobs, "finish_reason": reason}
        return f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': server.model_name, 'choices': [choice]})}\n\n"

    try:
        if chat:
            yield chunk("", None, first=True)
        while True:
            try:
                ids = read(await events.get(), stream)
            except Exception as exc:  # noqa: BLE001 - the request failed: its error ends the stream
                payload = {"error": {"message": str(exc), "type": "server_error", "code": None}}
                yield f"data: {json.dumps(payload)}\n\n"
                return
            if ids is None:
                break
            if piece := text.push(ids, stream):
                yield chunk(piece, None)
        if rest := text.flush():
            yield chunk(rest, None)
        yield chunk(None, text.finish(stream))
        if usage_chunk:
            yield (f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': server.model_name, 'choices': [], 'usage': server.usage(prompt, stream)})}\n\n")
        yield "data: [DONE]\n\n"
    finally:
        if stream.result is None:  # the client went away mid-stream: free the slot at the next step
            stream.cancel()
