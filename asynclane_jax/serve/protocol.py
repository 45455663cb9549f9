"""OpenAI request bodies read and checked, and the bodies of responses and stream chunks.

Every field of an OpenAI completions or chat-completions request is either honoured or
refused with a 400 that names it; none is silently ignored:

  model              must be the served name (else 404 model_not_found)
  prompt / messages  one prompt per request: a string or a list of token ids (or a list
                     of one of either) / the chat messages, through the tokenizer's chat
                     template (system, developer, user and assistant turns, text only)
  max_tokens         1 ..= the largest generation bucket; the engine decodes at the
                     smallest bucket >= max_tokens and cuts there. Default: the server's
                     --default-max-tokens (the largest bucket unless set).
                     `max_completion_tokens` (chat) is the same field.
  stop               a string or a list of up to 16: the text is cut before the first
                     one, finish_reason "stop", and the engine request cancelled
  stream             server-sent events; `stream_options` is accepted (usage always
                     comes in the final chunk)
  temperature        the sampler's `temperature` option when it has one; else only 0
  top_p              the sampler's `top_p` option when it has one; else only 1
  seed               accepted when decoding is greedy (temperature 0): under continuous
                     batching the rows share one random stream, so a per-request seed
                     cannot be honoured when sampling
  sampler_options    (an extra field) the sampler's own options, e.g. {"threshold": 0.8}:
                     names of the sampler's options, values numbers, strings, booleans or
                     short lists of them, checked by the engine; never `sampler` or
                     `gen_length` (the server's), nor options that name files (`routers`:
                     the operator's, set at start). Traced options (thresholds) take any
                     valid value per request, in the programs that exist; a structural
                     one (block length, cache, ...) must be the operator's, or one of
                     the configurations the operator allowed (`--allow-options`), else
                     a 400 (code option_not_allowed) naming what is allowed
  user               accepted (it changes nothing)
  n, best_of         only 1;  logprobs / top_logprobs, echo, suffix, logit_bias,
  penalties          presence / frequency penalties, tools / functions, response_format:
                     only their "off" values (null, false, 0, {}, [], "none", text)

Any other top-level field is a 400 naming it. So is a body nested deeper than
MAX_DEPTH, a string holding a lone surrogate, a number too large for a float, and a
prompt longer than the server's bound in characters (checked before tokenizing).
Messages quote a client's values cut short (`_show`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

MAX_STOP = 16
CHAT_ROLES = ("system", "developer", "user", "assistant")
# How deep a request body may nest (OpenAI's schema needs 5: messages, a message, its
# content parts, a part); deeper is a 400 before anything else reads it.
MAX_DEPTH = 32
# Options a request may never set: the sampler and the bucket are the server's, and
# options that name files are the operator's (set at start), never a client's.
STRUCTURAL_OPTIONS = {"sampler": "the sampler is the server's (asynclane-jax serve --sampler)",
                      "gen_length": "the generation length follows max_tokens (the server's "
                                    "buckets)"}
FILE_OPTIONS = ("routers",)


class RequestError(Exception):
    """A request the server refuses: an OpenAI-style error body with an HTTP status."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error",
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}, as OpenAI's API answers."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class ServingSpec:
    """What a request is checked against: the served model and sampler.

    Attributes:
      model_name: the only accepted `model`.
      sampler: the engine's sampler name.
      sampler_fields: that sampler's option names, with their defaults.
      server_options: the options the server was started with (they apply unless a
        request's sampler_options override them).
      max_tokens: the largest generation bucket.
      default_max_tokens: max_tokens when a request gives none.
      max_prompt: the longest prompt in tokens.
      vocab_size: token ids of a prompt must be below it.
      max_prompt_chars: the longest prompt text in characters (a chat's contents
        together), refused before it is tokenized (None: no bound but max_prompt).
    """

    model_name: str
    sampler: str
    sampler_fields: Mapping[str, Any]
    server_options: Mapping[str, Any]
    max_tokens: int
    default_max_tokens: int
    max_prompt: int
    vocab_size: int | None = None
    max_prompt_chars: int | None = None


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A checked request, ready for `Engine.submit`."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    options: dict  # per-request sampler options (over the server's)


# Fields and who reads them. "off" fields are accepted only at the value that changes
# nothing; everything else is refused by name.
_COMMON = {"model", "max_tokens", "stop", "stream", "stream_options", "temperature", "top_p",
           "seed", "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
           "user", "sampler_options"}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "best_of", "echo", "suffix"})
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                                   "tools", "tool_choice", "functions", "function_call",
                                   "response_format", "parallel_tool_calls"})


def _bad(message: str, param: str | None, code: str | None = None) -> RequestError:
    return RequestError(message, param=param, code=code)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer of hundreds of digits
        return False


def _show(v, limit: int = 60) -> str:
    """A value as a message quotes it: its repr, cut to `limit` characters."""
    try:
        text = repr(v)
    except (ValueError, RecursionError):  # an integer past Python's digit limit
        text = f"<a {type(v).__name__} too large to show>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_tree(body: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuses a decoded JSON body nested deeper than max_depth, or holding a string
    (or key) that is not valid Unicode (a lone surrogate such as "\\ud800", which JSON
    escapes can carry but no tokenizer or UTF-8 response can).

    Raises:
      RequestError: 400.
    """
    stack = [(body, 1, "")]
    while stack:
        v, depth, where = stack.pop()
        if depth > max_depth:
            raise _bad(f"the request body nests deeper than {max_depth} levels", None)
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_text(k, where or "the request body")
                stack.append((x, depth + 1, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            stack.extend((x, depth + 1, f"{where}[{i}]") for i, x in enumerate(v))


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"{where or 'the request body'}: a lone surrogate "
                   f"({s[e.start]!r}) is not valid Unicode text", where or None) from None


_ABS_PATH = re.compile(r"(?<![\w.:/~])(?:~|/(?!v1/))(?:[^\s/'\"]+/)+[^\s/'\",;)]*")


def scrub(message: str) -> str:
    """A message with the absolute paths in it replaced by <path> (errors from the
    engine or a library may name files of the server's machine)."""
    return _ABS_PATH.sub("<path>", message)


def redact_paths(obj: Any) -> Any:
    """obj with every string that is an absolute path (or under ~) replaced by <path>."""
    if isinstance(obj, str):
        return "<path>" if os.path.isabs(obj) or obj.startswith("~") else scrub(obj)
    if isinstance(obj, dict):
        return {k: redact_paths(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_paths(v) for v in obj]
    return obj


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or not lo <= v <= hi:
        raise _bad(f"{name}={_show(v)}: must be a number in [{lo:g}, {hi:g}]", name)
    return float(v)


def _only(body: dict, name: str, allowed: Sequence, why: str) -> None:
    """Refuses a field unless it is absent or at one of its values that change nothing."""
    if name not in body:
        return
    v = body[name]
    if any(type(v) is type(a) and v == a for a in allowed) or v is None:
        return
    raise _bad(f"{name}={_show(v)} is not supported: {why}", name)


def parse_request(body: Any, spec: ServingSpec, tokenizer, *, chat: bool) -> ParsedRequest:
    """Checks an OpenAI request body against the served model and builds the engine's
    request.

    Args:
      body: the decoded JSON body.
      spec: the served model and sampler.
      tokenizer: the model's tokenizer (the prompt is encoded with it, chat turns through
        its chat template).
      chat: a /v1/chat/completions request (else /v1/completions).

    Returns:
      The ParsedRequest.

    Raises:
      RequestError: the body is refused (400, or 404 for another model).
    """
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, not {type(body).__name__}", None)
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = [k for k in body if k not in known]
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise _bad(f"unknown field{'s' if len(unknown) > 1 else ''} {names}; this server "
                   f"accepts {', '.join(sorted(known))}", unknown[0])

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required: a string, the served model "
                   f"{spec.model_name!r}", "model")
    if model != spec.model_name:
        raise RequestError(f"The model {_show(model)} does not exist; this server serves "
                           f"{spec.model_name!r} (GET /v1/models)", param="model",
                           code="model_not_found", status=404)

    # What cannot be honoured: refused unless at its "off" value.
    if "n" in body and body["n"] is not None and not (_is_int(body["n"]) and body["n"] == 1):
        raise _bad(f"n={_show(body['n'])} is not supported: one choice per request (n=1)", "n")
    if chat:
        _only(body, "logprobs", (False,), "log-probabilities are not returned")
        _only(body, "top_logprobs", (0,), "log-probabilities are not returned")
        _only(body, "tools", ([],), "tool calls are not supported")
        _only(body, "functions", ([],), "function calls are not supported")
        _only(body, "tool_choice", ("none",), "tool calls are not supported")
        _only(body, "function_call", ("none",), "function calls are not supported")
        rf = body.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise _bad(f"response_format={_show(rf)} is not supported: only {{'type': 'text'}}",
                       "response_format")
        ptc = body.get("parallel_tool_calls")
        if ptc is not None and not isinstance(ptc, bool):
            raise _bad(f"parallel_tool_calls={_show(ptc)}: must be a boolean",
                       "parallel_tool_calls")
    else:
        _only(body, "logprobs", (), "log-probabilities are not returned")
        if "best_of" in body and body["best_of"] is not None and not (
                _is_int(body["best_of"]) and body["best_of"] == 1):
            raise _bad(f"best_of={_show(body['best_of'])} is not supported: only 1", "best_of")
        _only(body, "echo", (False,), "the prompt is not echoed")
        _only(body, "suffix", ("",), "insertion (a suffix) is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and not (_is_number(v) and v == 0):
            raise _bad(f"{name}={_show(v)} is not supported: only 0", name)
    lb = body.get("logit_bias")
    if lb is not None and lb != {}:
        raise _bad(f"logit_bias is not supported (got {_show(lb)}); only {{}} or null",
                   "logit_bias")

    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"stream={_show(stream)}: must be a boolean", "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _bad(f"stream_options={_show(so)}: must be an object", "stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad(f"user={_show(user)}: must be a string", "user")

    max_tokens = _max_tokens(body, spec, chat)
    stop = _stop(body)
    options = _options(body, spec)
    if chat:
        prompt_ids = _chat_prompt(body, tokenizer, spec)
        where = "messages"
    else:
        prompt_ids = _completion_prompt(body, tokenizer, spec)
        where = "prompt"
    if not prompt_ids:
        raise _bad(f"the {where} is empty after tokenization", where)
    if len(prompt_ids) > spec.max_prompt:
        raise _bad(f"the {where} is {len(prompt_ids)} tokens; this server takes at most "
                   f"{spec.max_prompt} (the model's context less the largest generation "
                   f"bucket, {spec.max_tokens})", where, code="context_length_exceeded")
    return ParsedRequest(chat=chat, prompt_ids=prompt_ids, max_tokens=max_tokens, stop=stop,
                         stream=bool(stream), options=options)


def _max_tokens(body: dict, spec: ServingSpec, chat: bool) -> int:
    names = ["max_tokens"] + (["max_completion_tokens"] if chat else [])
    given = {n: body[n] for n in names if body.get(n) is not None}
    for name, v in given.items():
        if not _is_int(v) or v < 1:
            raise _bad(f"{name}={_show(v)}: must be a positive integer", name)
        if v > spec.max_tokens:
            raise _bad(f"{name}={v} is more than this server generates: at most "
                       f"{spec.max_tokens} tokens per request (its largest generation "
                       "bucket)", name)
    if len(set(given.values())) > 1:
        raise _bad(f"max_tokens={given['max_tokens']} and max_completion_tokens="
                   f"{given['max_completion_tokens']} disagree; give one", "max_tokens")
    return next(iter(given.values()), spec.default_max_tokens)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
            or len(stops) > MAX_STOP):
        raise _bad(f"stop={_show(stop)}: must be a string or a list of at most {MAX_STOP} strings",
                   "stop")
    if any(s == "" for s in stops):
        raise _bad("stop: an empty string would stop before any text", "stop")
    return tuple(dict.fromkeys(stops))


def _options(body: dict, spec: ServingSpec) -> dict:
    """The per-request sampler options: `sampler_options`, with `temperature` and `top_p`
    mapped onto the sampler's options of those names; and the seed rule."""
    so = body.get("sampler_options")
    if so is None:
        so = {}
    if not isinstance(so, dict):
        raise _bad(f"sampler_options={_show(so)}: must be an object of {spec.sampler}'s options",
                   "sampler_options")
    for key, value in so.items():
        param = f"sampler_options.{key}"
        if key in STRUCTURAL_OPTIONS:
            raise _bad(f"{param} cannot be set per request: {STRUCTURAL_OPTIONS[key]}",
                       "sampler_options")
        if key in FILE_OPTIONS:
            raise _bad(f"{param} names files: only the operator sets it, when the server "
                       "starts, never a request", "sampler_options")
        if key not in spec.sampler_fields:
            raise _bad(f"sampler_options: unknown option {_show(key)} of the sampler "
                       f"{spec.sampler!r}; accepted: {', '.join(sorted(spec.sampler_fields))}",
                       "sampler_options")
        if not _option_value(value):
            raise _bad(f"{param}={_show(value)}: must be a number, a string, a boolean, null "
                       "or a short list of these", "sampler_options")
    options = dict(so)
    for name, lo, hi, neutral in (("temperature", 0.0, 2.0, 0.0), ("top_p", 0.0, 1.0, 1.0)):
        v = _number(body, name, lo, hi)
        if v is None:
            continue
        if name not in spec.sampler_fields:
            if v != neutral:
                raise _bad(f"{name}={v:g} is not supported by the sampler {spec.sampler!r}, "
                           f"which has no {name} option: only {name} {neutral:g} (or none)",
                           name)
            continue
        if name == "top_p" and v == 0:
            raise _bad("top_p=0 keeps no token: must be in (0, 1]", name)
        if name in options and options[name] != v:
            raise _bad(f"{name}={v:g} and sampler_options.{name}={_show(options[name])} "
                       "disagree; "
                       "give one", name)
        options[name] = v
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise _bad(f"seed={_show(seed)}: must be an integer", "seed")
        temp = options.get("temperature", spec.server_options.get(
            "temperature", spec.sampler_fields.get("temperature", 0.0)))
        if _is_number(temp) and temp > 0:
            raise _bad(f"seed is not honoured at temperature {temp:g}: under continuous "
                       "batching the requests in the loop share one random stream, so a "
                       "per-request seed cannot make sampling repeatable; send temperature "
                       "0 (greedy, which needs no seed) or no seed", "seed")
    return options


def _option_value(v, top: bool = True) -> bool:
    if v is None or isinstance(v, (bool, str)):
        return not isinstance(v, str) or len(v) <= 256
    if isinstance(v, (int, float)):
        return _is_number(v)
    return top and isinstance(v, list) and len(v) <= 64 and all(
        _option_value(x, top=False) for x in v)


def _prompt_chars(n: int, where: str, spec: ServingSpec) -> None:
    if spec.max_prompt_chars is not None and n > spec.max_prompt_chars:
        raise _bad(f"the {where} is {n} characters; this server takes at most "
                   f"{spec.max_prompt_chars} (its prompts are at most {spec.max_prompt} "
                   "tokens)", where, code="context_length_exceeded")


def _encode(tokenizer, text: str, where: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as e:  # a tokenizer that refuses the text: the client's input
        raise _bad(f"the {where} could not be tokenized ({type(e).__name__})", where) \
            from None


def _completion_prompt(body: dict, tokenizer, spec: ServingSpec) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _prompt_chars(len(prompt), "prompt", spec)
        return _encode(tokenizer, prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) > spec.max_prompt:
        raise _bad(f"the prompt is {len(prompt)} tokens; this server takes at most "
                   f"{spec.max_prompt}", "prompt", code="context_length_exceeded")
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt
               if t < 0 or (spec.vocab_size is not None and t >= spec.vocab_size)]
        if bad:
            raise _bad(f"prompt: token id(s) {_show(bad[:5])} outside the vocabulary "
                       f"[0, {spec.vocab_size})", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad(f"prompt: {len(prompt)} prompts in one request; this server takes one "
                   "prompt per request (send them as separate requests: they are batched "
                   "together in the decode loop)", "prompt")
    raise _bad("prompt: must be a string or a list of token ids", "prompt")


def _chat_prompt(body: dict, tokenizer, spec: ServingSpec) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required: a non-empty list of {role, content}", "messages")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where}: must be an object with role and content", where)
        extra = [k for k in m if k not in ("role", "content")]
        if extra:
            raise _bad(f"{where}: field(s) {', '.join(map(repr, extra))} not supported (only "
                       "role and content)", f"{where}.{extra[0]}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role={_show(role)}: must be one of {', '.join(CHAT_ROLES)}",
                       f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (not isinstance(part, dict) or part.get("type") != "text"
                        or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}):
                    raise _bad(f"{where}.content[{j}]: only text parts "
                               "({'type': 'text', 'text': ...}) are supported",
                               f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content: must be a string or a list of text parts",
                       f"{where}.content")
        turns.append({"role": role, "content": content})
    _prompt_chars(sum(len(t["content"]) for t in turns), "messages", spec)
    if not getattr(tokenizer, "chat_template", None):
        raise _bad("this model's tokenizer has no chat template: use /v1/completions",
                   "messages")
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:  # the template refuses these turns (e.g. their order)
        raise _bad(f"messages: the chat template refused them ({type(e).__name__}: "
                   f"{scrub(str(e))[:200]})", "messages") from None
    return _encode(tokenizer, text, "messages")


class StopCutter:
    """Cuts streamed text before the first stop string.

    Text that could be the start of a stop string is held back until it is known not to
    be one, so a stop string split across deltas is still found and nothing after it is
    ever sent.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (the text that can be sent now, whether a stop string was reached)."""
        if not self.stops:
            return delta, False
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return text[:min(hits)], True
        hold = 0
        for k in range(min(len(text), max(map(len, self.stops)) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                hold = k
                break
        self._pending = text[len(text) - hold:]
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The held-back text, at the end of the stream (it was no stop string)."""
        out, self._pending = self._pending, ""
        return out


# ------------------------------------------------------------------- response bodies

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str,
                    use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use}


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str,
              use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str,
                     finish_reason: str | None = None, use: dict | None = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": None,
                        "finish_reason": finish_reason}]}
    if use is not None:
        out["usage"] = use
    return out


def chat_chunk(rid: str, created: int, model: str, delta: dict,
               finish_reason: str | None = None, use: dict | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None,
                        "finish_reason": finish_reason}]}
    if use is not None:
        out["usage"] = use
    return out


def now() -> int:
    return int(time.time())
