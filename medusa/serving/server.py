"""An OpenAI-compatible HTTP server over a :class:`~medusa.serving.scheduler.Scheduler`.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health``. Every request's tokens come from the
one scheduler thread that owns the engine, batched with whatever else runs, and are the tokens
the request gets alone (docs/exactness.md#batches). ``usage`` carries ``tokens_per_pass`` (tau).

Errors follow OpenAI's shape (``{"error": {"message", "type", "code"}}``): 400 for a bad request
(one line naming the field), 401 without the ``--api-key``, 429 when the queue is full, 503 while
shutting down. A client that disconnects cancels its request: the slot frees at the next step.
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
from fastapi.responses import JSONResponse, StreamingResponse

from medusa.decoding.engine import Engine
from medusa.decoding.text import TextStream
from medusa.errors import MedusaError
from medusa.serving.scheduler import Closed, Overloaded, Scheduler, Stream

log = logging.getLogger("medusa.serving")

FINISH = {"eos": "stop", "length": "length", "context": "length", "stopped": "stop"}


class BadRequest(MedusaError):
    """A request the server refuses with 400 (the message names the field and the fix)."""


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def _number(body: dict, name: str, default, kind=float, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and int(value) != value):
        raise BadRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    value = kind(value)
    if low is not None and (value <= low if low_open else value < low):
        raise BadRequest(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise BadRequest(f"{name} must be <= {high}, got {value}")
    return value


class Server:
    """The app's state: the engine, its scheduler, the served model's name and the key."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None, max_batch: int = 8,
                 max_queue: int = 64, default_max_tokens: int = 256, mode: str | None = None) -> None:
        if engine.tokenizer is None:
            raise MedusaError("the server needs the engine's tokenizer: load it with medusa.load")
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.default_max_tokens, self.mode = default_max_tokens, mode
        self.scheduler = Scheduler(engine, max_batch=max_batch, max_queue=max_queue)
        self.created = int(time.time())

    # -- requests -> scheduler arguments -------------------------------------------------
    def _sampling(self, body: dict) -> dict:
        if body.get("n", 1) != 1:
            raise BadRequest("n must be 1: this server returns one choice per request")
        temperature = _number(body, "temperature", 1.0, low=0.0, high=2.0)
        top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest(f"seed must be an integer, got {seed!r}")
        args = {"temperature": temperature, "top_p": top_p, "seed": seed}
        if "top_k" in body:
            args["top_k"] = _number(body, "top_k", 0, kind=int, low=0)
        return args

    def _max_tokens(self, body: dict, prompt: int) -> int:
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        n = _number(body, key, self.default_max_tokens, kind=int, low=1)
        window = self.engine.max_positions
        if window is not None and prompt + n > window:
            raise BadRequest(f"the prompt has {prompt} tokens and {key} is {n}: together over the model's context of "
                             f"{window} tokens; lower {key} or shorten the prompt")
        return n

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"unknown model {model!r}: this server serves {self.model_name!r} (GET /v1/models)")

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRequest("each message must be an object with a string role and string content")
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest(f"{self.model_name} has no chat template: use /v1/completions with a prompt")
        ids = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def text_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string")
        return list(self.engine.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def submit(self, ids: list[int], body: dict, listener) -> Stream:
        args = self._sampling(body)
        n = self._max_tokens(body, len(ids))
        return self.scheduler.submit(ids, max_new_tokens=n, mode=self.mode, listener=listener, **args)

    def usage(self, prompt: int, stream: Stream) -> dict:
        result = stream.result
        done = 0 if result is None else len(result.tokens)
        tau = 0.0 if result is None or not result.stats.steps else result.stats.tau
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "tokens_per_pass": round(tau, 3)}


async def _read(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def create_app(server: Server) -> FastAPI:
    """The ASGI app; its lifespan starts the scheduler and, at shutdown, lets running streams
    finish before the scheduler stops."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        yield
        await asyncio.to_thread(server.scheduler.close)

    app = FastAPI(title="medusa", lifespan=lifespan)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if server.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                return error(401, "missing or wrong API key: send Authorization: Bearer KEY", "authentication_error",
                             "invalid_api_key")
        return await call_next(request)

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
    """One completion request: checked and queued, then streamed as events or answered whole."""
    try:
        body = await _read(request)
        server._check_model(body)
        ids = server.chat_prompt(body) if chat else server.text_prompt(body)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        # the scheduler thread hands each event to this loop as it is queued
        stream = server.submit(ids, body, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    except Overloaded as exc:
        return error(429, str(exc), "rate_limit_error", "queue_full")
    except Closed as exc:
        return error(503, str(exc), "server_error", "shutting_down")
    except MedusaError as exc:
        return error(400, str(exc))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    text = TextStream(server.engine.tokenizer)
    if body.get("stream"):
        usage_chunk = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_sse(server, stream, events, text, rid, chat, len(ids), usage_chunk, request),
                                 media_type="text/event-stream")
    content = await _collect(stream, events, text, request)
    if not isinstance(content, str):
        return content  # an error response
    reason = FINISH.get(stream.result.finish_reason, "stop")
    choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason}
              if chat else {"index": 0, "text": content, "logprobs": None, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": [choice], "usage": server.usage(len(ids), stream)}


async def _collect(stream: Stream, events: asyncio.Queue, text: TextStream, request: Request):
    """A non-streamed answer's text, whole (or the error response that ended it); a client that
    goes away cancels the stream."""
    parts = []
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    stream.cancel()
                    return error(499, "the client went away")
                continue
            if kind == "tokens":
                parts.append(text.push(value))
            elif kind == "done":
                stream.result = value
                break
            else:
                return error(500, str(value), "server_error")
    except asyncio.CancelledError:
        stream.cancel()
        raise
    parts.append(text.flush())
    return "".join(parts)


async def _sse(server: Server, stream: Stream, events: asyncio.Queue, text: TextStream, rid: str, chat: bool,
               prompt: int, usage_chunk: bool, request: Request) -> AsyncIterator[str]:
    """Server-sent events: one chunk per accepted step, the finish reason, [DONE]."""
    created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": piece or ""} if first else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
        return f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': server.model_name, 'choices': [choice]})}\n\n"

    try:
        if chat:
            yield chunk("", None, first=True)
        while True:
            kind, value = await events.get()
            if kind == "tokens":
                if piece := text.push(value):
                    yield chunk(piece, None)
            elif kind == "done":
                stream.result = value
                break
            else:
                payload = {"error": {"message": str(value), "type": "server_error", "code": None}}
                yield f"data: {json.dumps(payload)}\n\n"
                return
        if rest := text.flush():
            yield chunk(rest, None)
        yield chunk(None, FINISH.get(stream.result.finish_reason, "stop"))
        if usage_chunk:
            yield (f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': server.model_name, 'choices': [], 'usage': server.usage(prompt, stream)})}\n\n")
        yield "data: [DONE]\n\n"
    finally:
        if stream.result is None:  # the client went away mid-stream: free the slot at the next step
            stream.cancel()
