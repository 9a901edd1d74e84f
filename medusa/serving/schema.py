"""The OpenAI request bodies the server accepts, as pydantic models: a request is checked whole,
before it is tokenized or queued, and every field this server does not implement is refused by
name (a 400), never ignored. docs/serving.md#openai-fields lists what is supported.

Numbers are strict (``"1"`` or ``true`` is not a number), strings must be valid Unicode (no lone
surrogates), and JSON's non-standard ``NaN``/``Infinity`` are refused when the body is parsed
(:func:`parse_body`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from medusa.decoding.penalties import Penalties
from medusa.decoding.sampling import SEED_RANGE
from medusa.errors import MedusaError
from medusa.serving.stops import MAX_STOPS

Number = Annotated[float, Field(strict=True)]  # an int or a float, not a string or a bool


class BadRequest(MedusaError):
    """A request the server refuses with 400 (the message names the field and the fix)."""


class Unsupported(BadRequest):
    """A field this server does not implement, set to something other than its neutral value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id...: metadata the template does not read

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        """The content as one string: parts joined, ``null`` (an assistant turn) as empty."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# Fields clients send whose neutral value changes nothing: accepted at that value, refused otherwise.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "tools": ([],),
    "tool_choice": ("none",), "parallel_tool_calls": (False, True), "best_of": (1,), "suffix": ("",),
    "response_format": ({"type": "text"},),
}


class _Request(_Strict):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    seed: StrictInt | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: StrictInt = Field(1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    user: StrictStr | None = None
    # this server's own: at most this many drafted tokens verified a step (0: no speculation)
    max_draft_tokens: StrictInt | None = Field(None, ge=0)
    # the target's distribution adjusted (medusa/decoding/penalties.py; vLLM's meaning of each)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[StrictStr, Annotated[float, Field(strict=True, ge=-100, le=100)]] | None = None
    min_tokens: StrictInt | None = Field(None, ge=0)
    ignore_eos: StrictBool | None = None
    # the fields below are accepted at their neutral value only (NEUTRAL)
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"must hold at most {MAX_STOPS} strings, got {len(stops)}")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def penalties(self, vocab: int) -> Penalties | None:
        """The request's adjustments of the target's distribution (None: none asked for);
        ``logit_bias`` keys are token ids, as strings (JSON object keys), below ``vocab``."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab:
                raise BadRequest(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})")
            bias.append((int(key), float(value)))
        penalties = Penalties(presence=self.presence_penalty or 0.0, frequency=self.frequency_penalty or 0.0,
                              bias=tuple(bias), min_tokens=self.min_tokens or 0)
        return penalties if (penalties.presence or penalties.frequency or bias or penalties.min_tokens) else None

    def sampling(self) -> dict:
        """The scheduler's sampling arguments (unset fields keep the engine's defaults: greedy
        only where the client asks for temperature 0, as OpenAI's default temperature is 1)."""
        args = {"temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "seed": self.seed}
        if self.top_k is not None:
            args["top_k"] = self.top_k
        return args


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    def wants_logprobs(self) -> int | None:
        """How many alternatives per token to report with its log-probability (None: no logprobs)."""
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    def wants_logprobs(self) -> int | None:
        return self.logprobs

    def one_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; a list of several prompts is refused (one choice a request)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise Unsupported(f"prompt: a list of {len(prompt)} prompts; this server answers one prompt a "
                                  "request: send them as separate requests")
            prompt = prompt[0]
        if not prompt:
            raise BadRequest("prompt must be a non-empty string or list of token ids")
        return prompt


def _no_constants(name: str):
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body: a one-line :class:`BadRequest` for anything else."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({getattr(exc, 'msg', exc)})") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_text(body, "body")
    return body


def _check_text(value, where: str) -> None:
    """Refuse strings that are not valid Unicode (JSON allows lone surrogates; tokenizers do not)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"{where}: the text holds an unpaired surrogate (\\ud800-\\udfff): send valid UTF-8 "
                             "text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}" if where != "body" else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")


MUST = {"greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}", "less_than_equal": "must be <= {le}",
        "less_than": "must be < {lt}", "int_type": "must be an integer", "int_parsing": "must be an integer",
        "int_from_float": "must be an integer", "float_type": "must be a number", "float_parsing": "must be a number",
        "bool_type": "must be true or false", "bool_parsing": "must be true or false", "string_type": "must be a string",
        "too_short": "must be a non-empty list", "list_type": "must be a list", "dict_type": "must be an object",
        "model_type": "must be an object", "missing": "is required"}


def _said(err: dict) -> str:
    """pydantic's error as the rest of a one-line sentence: what the field must be, what it got."""
    rule = MUST.get(err["type"])
    text = rule.format(**err.get("ctx", {})) if rule else err["msg"].removeprefix("Value error, ")
    text = text[:1].lower() + text[1:]
    got = err.get("input")
    if err["type"] != "missing" and not isinstance(got, (dict, list)) and got is not None:
        text += f", got {json.dumps(got)[:60]}"
    return text


def validate(body: dict, chat: bool) -> ChatRequest | CompletionRequest:
    """``body`` checked whole against the endpoint's schema: the first problem as one line naming
    the field, fields this server does not implement refused by name (:class:`Unsupported`)."""
    model = ChatRequest if chat else CompletionRequest
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".") or "body"
        if err["type"] == "extra_forbidden":
            raise Unsupported(f"{field}: not supported by this server (docs/serving.md#openai-fields lists the fields "
                              "it takes): remove it") from None
        raise BadRequest(f"{field} {_said(err)}") from None
    for name, neutral in NEUTRAL.items():
        value = getattr(request, name, None)
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise Unsupported(f"{name}: not supported by this server (accepted only as {json.dumps(neutral[0])}, "
                              f"got {json.dumps(value)[:60]}); docs/serving.md#openai-fields lists the fields it takes")
    return request
