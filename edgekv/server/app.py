"""The HTTP side of ``edgekv serve``: an OpenAI-compatible API on Starlette.

Starlette (with uvicorn) because it is the small, well-kept ASGI core under
FastAPI: streaming responses for server-sent events, routing and nothing else
to learn. Request validation is written here rather than left to a schema
library so that every refusal is an OpenAI-format error naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import random
import time
import tracemalloc
import uuid
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import EdgekvError
from ..llama import SamplerConfig
from .conversations import ServerConfig, Store
from .turns import RequestError, Turn, Worker

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "audio", "prediction")


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _number(body: dict, name: str, lo: float, hi: float, *, integer: bool = False, default: Any = None) -> Any:
    """A numeric field in [lo, hi] (null = default); bools are not numbers here."""
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or (not integer and not math.isfinite(v)):
        raise RequestError(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}",
                           param=name, code="invalid_type")
    if not lo <= v <= hi:
        raise RequestError(f"'{name}' must be between {lo:g} and {hi:g}, got {v}", param=name, code="invalid_value")
    return v


def _typed(body: dict, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    v = body.get(name)
    if v is not None and (not isinstance(v, kind) or isinstance(v, bool) and kind is not bool):
        raise RequestError(f"'{name}' must be {what}, got {json.dumps(v)[:80]}", param=name, code="invalid_type")
    return v


def _content(v: Any, i: int) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # content parts: text only
        out = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content",
                                   code="unsupported_content")
            out.append(part["text"])
        return "".join(out)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content",
                       code="invalid_type")


class App:
    """Routes over one Store and its Worker."""

    def __init__(self, cfg: ServerConfig, *, api_key: str | None = None) -> None:
        self.cfg = cfg
        self.api_key = api_key
        self.store = Store(cfg)
        try:
            self.store.warm()
        except BaseException:
            self.store.close()
            raise
        self.worker = Worker(self.store)
        self.started = int(time.time())
        self.asgi = Starlette(routes=[
            Route("/", self.page),
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/edgekv/stats", self.stats),
        ], lifespan=self._lifespan, max_body_size=64 << 20)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and self.api_key is not None:
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                resp = _error(RequestError("invalid or missing API key (Authorization: Bearer ...)", status=401,
                                           code="invalid_api_key"))
                await resp(scope, receive, send)
                return
        await self.asgi(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        yield
        self.close()

    def close(self) -> None:
        """Stop the worker and free every conversation (contexts and session files)."""
        self.worker.close()
        self.store.close()

    # -- simple routes ------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        html = resources.files("edgekv.server").joinpath("page.html").read_text(encoding="utf-8")
        return HTMLResponse(html)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.cfg.model_id, "object": "model", "created": self.started, "owned_by": "edgekv"}]})

    async def stats(self, request: Request) -> Response:
        snap = self.store.snapshot()
        snap["totals"]["active_requests"] = self.worker.active
        # soak tests watch these stay flat (traced when the server runs with PYTHONTRACEMALLOC=1)
        tracing = tracemalloc.is_tracing()
        snap["process"] = {"python_heap_mib": tracemalloc.get_traced_memory()[0] / 2**20 if tracing else None,
                           "tracemalloc_mib": tracemalloc.get_tracemalloc_memory() / 2**20 if tracing else 0.0}
        want = request.query_params.get("conversation")
        if want is not None:
            convs = [c for c in snap["conversations"] if c["id"] == want]
            if not convs:
                return _error(RequestError(f"no conversation {want!r}", status=404, code="not_found",
                                           param="conversation"))
            snap["conversations"] = convs
        return JSONResponse(snap)

    # -- parsing -------------------------------------------------------------------
    async def _body(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise RequestError(f"the request body is not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", code="invalid_json")
        model = _typed(body, "model", str, "a string")
        if model is None:
            raise RequestError("'model' is required", param="model", code="missing_required_parameter")
        if model not in (self.cfg.model_id, self.cfg.model.path.stem, self.cfg.model.path.name):
            raise RequestError(f"the model {model!r} does not exist; this server runs {self.cfg.model_id!r}",
                               status=404, param="model", code="model_not_found")
        for name in UNSUPPORTED:
            if body.get(name):
                raise RequestError(f"'{name}' is not supported by edgekv serve", param=name,
                                   code="unsupported_parameter")
        fmt = body.get("response_format")
        for name, used in (("logprobs", body.get("logprobs")), ("top_logprobs", body.get("top_logprobs")),
                           ("echo", body.get("echo")), ("suffix", body.get("suffix") is not None),
                           ("logit_bias", body.get("logit_bias")),
                           ("response_format", fmt is not None and fmt != {"type": "text"})):
            if used:
                raise RequestError(f"'{name}' is not supported by edgekv serve", param=name,
                                   code="unsupported_parameter")
        for name in ("n", "best_of"):
            if _number(body, name, 1, 1 << 10, integer=True, default=1) != 1:
                raise RequestError(f"only {name} = 1 is supported", param=name, code="unsupported_parameter")
        return body

    def _turn(self, body: dict, kind: str) -> Turn:
        cfg = self.cfg
        max_tokens = _number(body, "max_completion_tokens", 1, 1 << 20, integer=True)
        if max_tokens is None:
            max_tokens = _number(body, "max_tokens", 1, 1 << 20, integer=True, default=cfg.max_tokens)
        sampler = SamplerConfig(
            temperature=float(_number(body, "temperature", 0, 2, default=cfg.temperature)),
            top_p=float(_number(body, "top_p", 0, 1, default=0.95)) or 1.0,
            # no seed: a fresh draw per request, as OpenAI's API does
            seed=int(_number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True,
                             default=random.getrandbits(32))) & 0xFFFFFFFF,
        )
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise RequestError("'stop' must be a string or a list of up to 4 non-empty strings", param="stop",
                               code="invalid_type")
        _typed(body, "stream", bool, "true or false")
        opts = _typed(body, "stream_options", dict, "an object")
        if opts is not None:
            _typed(opts, "include_usage", bool, "true or false")
        method = _typed(body, "method", str, "a method name (GET /v1/edgekv/stats lists the server's defaults)")
        budget = _number(body, "budget", 1, 1 << 31, integer=True)
        ratio = _number(body, "ratio", 0, 1)
        params = _typed(body, "method_params", dict, "an object of method parameters")
        settings = rule = built = None
        if method is not None or budget is not None or ratio is not None or params:
            try:
                settings = cfg.settings(method, budget, ratio, params)
                rule = settings.rule(cfg.n_ctx)
                built = rule.build()
                self.store.check_method(built)  # a method this engine lacks: 400, no conversation made
            except EdgekvError as e:
                msg = str(e)
                param = ("method_params" if params and any(k in msg for k in params)
                         else "budget" if budget is not None and "budget" in msg
                         else "ratio" if ratio is not None and "ratio" in msg else "method")
                raise RequestError(str(e).replace("--budget", "budget").replace("--ratio", "ratio"),
                                   param=param, code="invalid_value") from None
        turn = Turn(kind=kind, settings=settings, rule=rule, method=built, max_tokens=max_tokens, sampler=sampler,
                    stop=tuple(stop or ()))
        if kind == "chat":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise RequestError("'messages' must be a non-empty list", param="messages",
                                   code="invalid_type" if msgs is not None else "missing_required_parameter")
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
                    raise RequestError(f"messages[{i}] needs a role of {', '.join(ROLES)}", param=f"messages[{i}].role",
                                       code="invalid_value")
                turn.messages.append({"role": ROLES[m["role"]], "content": _content(m.get("content"), i)})
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise RequestError("'prompt' must be a non-empty string (one prompt per request)", param="prompt",
                                   code="invalid_type")
            turn.prompt = prompt
        return turn

    # -- the two completion routes ---------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def _serve(self, request: Request, kind: str) -> Response:
        try:
            body = await self._body(request)
            turn = self._turn(body, kind)
        except RequestError as e:
            return _error(e)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        job = self.worker.submit(turn, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        try:
            first, payload = await queue.get()
        except asyncio.CancelledError:
            job.cancel()
            raise
        if first == "error":
            return _error(payload)
        ready = payload
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._stream(queue, job, kind, rid, created, usage, ready),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                ev, payload = await queue.get()
                if ev == "error":
                    return _error(payload)
                if ev == "done":
                    break
        finally:
            job.cancel()
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": payload["content"]},
                      "finish_reason": payload["finish_reason"], "logprobs": None}
        else:
            choice = {"index": 0, "text": payload["content"], "finish_reason": payload["finish_reason"],
                      "logprobs": None}
        return JSONResponse({
            "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": self.cfg.model_id, "choices": [choice], "usage": payload["usage"], "edgekv": payload["edgekv"],
        })

    async def _stream(self, queue: asyncio.Queue, job, kind: str, rid: str, created: int, usage: bool,
                      ready: dict[str, Any]):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, **extra: Any) -> str:
            if kind == "chat":
                d: dict[str, Any] = {} if delta is None else {"content": delta}
                if delta == "" and finish is None:
                    d = {"role": "assistant", "content": ""}
                choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            if usage:
                extra.setdefault("usage", None)  # OpenAI sends null on every chunk but the usage one
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.cfg.model_id,
                                          "choices": [choice], **extra}) + "\n\n"

        try:
            # the first chunk names the conversation, so a client (the page) can follow its stats at once
            yield chunk("", edgekv=ready) if kind == "chat" else chunk(None, edgekv=ready)
            while True:
                ev, payload = await queue.get()
                if ev == "delta":
                    yield chunk(payload)
                elif ev == "done":
                    yield chunk(None, payload["finish_reason"], edgekv=payload["edgekv"])
                    if usage:
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                     "model": self.cfg.model_id, "choices": [],
                                                     "usage": payload["usage"]}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                elif ev == "error":
                    yield "data: " + json.dumps(payload.body()) + "\n\n"
                    return
        finally:
            job.cancel()  # a client that went away mid-stream: the worker closes the turn


__all__ = ["App"]
