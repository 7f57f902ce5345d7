"""The Starlette application: routes, API key, request reading, and the ASGI responses of generations.

A generation request is checked completely (key, body size, JSON, fields, model, prompt length,
options) before it is queued, so that every bad input is a 4xx with OpenAI's error JSON and the
worker only ever sees runnable requests. Its response watches for the client's disconnect from
the moment it is queued: a client that leaves cancels its job (queued: it never runs; running:
it stops after the round in progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..config import GeneratorConfig
from ..errors import InvalidArgument, PromptError
from ..generator import validate_prompt_ids
from ..limits import context_overflow
from ..slots import too_few_slots
from ..structured import Grammar, GrammarError, StructuredUnavailable
from ..tools import ToolError, ToolPlan
from .batch_worker import BatchWorker
from .config import ServerConfig, prefix_namespace
from .cors import CorsMiddleware
from .errors import INVALID_REQUEST, NOT_FOUND, SERVER, ApiError, bad_request, check_api_key
from .metrics import CONTENT_TYPE, Metrics
from .page import web_page
from .responses import DONE, Renderer, sse
from .schemas import CHAT, GenerationRequest, check_model, parse_chat, parse_completion
from .worker import Failed, Finished, Job, Round, Started, Worker, shutting_down

log = logging.getLogger("specexport.server")
CUT_GRACE_SECONDS = 5.0  # after the drain deadline: time for the running round to end and its last chunk to go out
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    config: GeneratorConfig  # the request's, checked against the artifact
    plan: ToolPlan | None = None  # chat: how tool calls are read from the answer


def make_worker(gen, config: ServerConfig, metrics: Metrics) -> Worker:
    """The batch-1 worker, or with config.max_batch > 1 the batching one (the generator must
    hold the artifact's batch graph of at least that many slots: load(..., batch=True))."""
    if config.max_batch == 1:
        return Worker(gen, config, metrics)
    if gen.slots is None or config.max_batch > gen.slots.slots:
        raise too_few_slots(gen.root, gen.manifest.target.max_batch, config.max_batch)
    return BatchWorker(gen, config, metrics, config.max_batch)


class ServerState:
    """What the routes share: the generator (only the worker generates with it), settings, worker, metrics."""

    def __init__(self, gen, config: ServerConfig):
        self.gen, self.config = gen, config
        self.model = config.model_name or gen.manifest.name
        self.default_proposer = gen.resolve_proposer(config.proposer)  # a bad --proposer fails at start
        # a request's defaults: the generator's config with the server's default proposer
        self.base = gen.configure(proposer=self.default_proposer)
        self.metrics = Metrics(self.model)
        self.metrics.watch_prefix_cache(gen.prefix_cache.describe)
        self.worker = make_worker(gen, config, self.metrics)
        self.created = int(time.time())
        self._key = config.api_key.encode() if config.api_key is not None else None

    def authorize(self, request: Request) -> None:
        """Raise 401 unless the request carries the API key (when one is set)."""
        check_api_key(self._key, request.headers.get("authorization"))

    def cache_salt(self, request: Request) -> str:
        """The prefix pool's namespace of a request (prefix_cache.py): one per Authorization header
        presented, so no key sees another's cached prefixes (or their timing), unless the server
        shares them (--share-prefix-cache)."""
        return prefix_namespace(request.headers.get("authorization"), self.config.share_prefix_cache)

    def prepare(self, req: GenerationRequest, salt: str = "") -> Prepared:
        """Tokenize and check a request against the artifact (runs in a thread pool: templates and
        tokenizers are thread-safe, and the generator's mutable state is not touched); salt: its
        prefix pool namespace (cache_salt)."""
        codec, manifest = self.gen.codec, self.gen.manifest
        param = "messages" if req.kind == CHAT else "prompt"
        plan = grammar = None
        try:
            if req.kind == CHAT:
                chat = self.gen.prepare_chat(req.messages, req.tools, req.tool_choice, req.parallel_tool_calls)
                ids, plan, grammar = chat.ids, chat.plan, chat.grammar
            elif isinstance(req.prompt, str):
                ids = codec.encode(req.prompt)
            else:
                ids = list(req.prompt)
        except ToolError as exc:
            raise bad_request(str(exc), exc.param) from None
        except StructuredUnavailable as exc:
            raise bad_request(str(exc), "tools") from None
        except (InvalidArgument, PromptError) as exc:
            raise bad_request(str(exc), param) from None
        grammar = self._grammar(req, grammar)
        context = manifest.max_context
        if len(ids) >= context:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this model's context holds {context} and at least"
                " one must stay free for the answer",
                INVALID_REQUEST,
                param,
                "context_length_exceeded",
            )
        try:
            ids = validate_prompt_ids(ids, manifest.target.embedding_rows, context)
        except PromptError as exc:
            raise bad_request(str(exc), param) from None
        s = req.sampling
        room = context - len(ids)
        max_tokens = room if s.max_tokens is None else s.max_tokens
        overflow = context_overflow(req.max_tokens_param, max_tokens, len(ids), context)
        if overflow is not None:
            raise ApiError(400, overflow, INVALID_REQUEST, req.max_tokens_param, "context_length_exceeded")
        try:
            proposer = self.gen.resolve_proposer(s.proposer or self.default_proposer)
        except InvalidArgument as exc:
            raise bad_request(str(exc), "proposer") from None
        try:
            config = self.gen.configure(
                self.base,
                proposer=proposer,
                max_new_tokens=max_tokens,
                gamma=s.gamma,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                min_p=s.min_p,
                repetition_penalty=s.repetition_penalty,
                seed=s.seed,
                stop=s.stop,
                grammar=grammar,
                logprobs=req.logprobs,
                cache_prompt=s.cache_prompt,
                cache_salt=salt,
            )
        except InvalidArgument as exc:  # schemas check the same ranges; this is the runtime's own word
            raise bad_request(str(exc), None) from None
        return Prepared(ids, config, plan)

    def _grammar(self, req: GenerationRequest, tool_grammar: Grammar | None) -> Grammar | None:
        """The request's grammar (tools', or response_format's), compiled once here so that a
        schema llguidance refuses is a 400 naming its field."""
        fmt, param = req.response_format, "tools" if tool_grammar is not None else "response_format"
        if fmt is not None and tool_grammar is not None:
            raise bad_request(
                "response_format and tools with tool_choice other than 'none' cannot be combined", "response_format"
            )
        try:
            grammar = tool_grammar
            if fmt is not None:
                grammar = (
                    Grammar.json_object()
                    if fmt["type"] == "json_object"
                    else Grammar.json_schema(fmt["schema"], strict=fmt["strict"])
                )
            if grammar is not None:
                self.gen.constraints().matcher(grammar)
        except StructuredUnavailable as exc:
            raise bad_request(str(exc), param) from None
        except GrammarError as exc:
            raise bad_request(f"{param}: {exc}", param if param == "tools" else "response_format") from None
        return grammar

    async def drain(self, forced=lambda: False) -> None:
        """SIGTERM: refuse new requests (503), fail the queued ones, let the running one go on for
        drain_seconds and then cut it after its round with a final chunk; return when the worker is
        idle (or when `forced()` turns true: a second Ctrl-C)."""
        self.worker.begin_drain(self.config.drain_seconds)
        limit = time.monotonic() + self.config.drain_seconds + CUT_GRACE_SECONDS
        while not self.worker.idle and time.monotonic() < limit and not forced():
            await asyncio.sleep(0.02)


# --- request reading -----------------------------------------------------------------------------
def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
        INVALID_REQUEST,
        None,
        "request_too_large",
    )


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int, seconds: float = math.inf):
    """The request body as JSON: 413 over `limit` bytes, 408 when it has not all arrived within
    `seconds` of the headers (a stalled upload is not held open)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()

    async def receive_all() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise _too_large(limit)

    try:
        await asyncio.wait_for(receive_all(), None if math.isinf(seconds) else seconds)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {seconds:g} s (--body-seconds); {len(body)} bytes came",
            INVALID_REQUEST,
            None,
            "request_timeout",
            {"Connection": "close"},  # the rest of the body will not come
        ) from None
    if not body.strip():
        raise bad_request("the request body is empty (expected a JSON object)", None, "invalid_json")
    try:
        return json.loads(bytes(body), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None


# --- routes --------------------------------------------------------------------------------------
def _state(request: Request) -> ServerState:
    return request.app.state.server


async def chat_completions(request: Request):
    return await _generation(request, parse_chat)


async def completions(request: Request):
    return await _generation(request, parse_completion)


async def _generation(request: Request, parse):
    arrived = time.monotonic()
    state = _state(request)
    state.authorize(request)
    if state.worker.draining:
        raise shutting_down()
    req = parse(await read_json(request, state.config.max_body_bytes, state.config.body_seconds))
    check_model(req.model, state.model)
    prepared = await run_in_threadpool(state.prepare, req, state.cache_salt(request))
    job = Job(prepared.prompt_ids, prepared.config, arrived, arrived + state.config.request_timeout)
    job.trace = req.trace and req.stream
    if prepared.plan is not None and prepared.plan.multiple:
        job.until = prepared.plan.repeats
    state.worker.submit(job)
    renderer = Renderer(
        req.kind,
        state.model,
        req.include_usage,
        req.return_token_ids,
        prepared.plan,
        state.gen.codec if req.logprobs is not None else None,
    )
    if job.trace:
        renderer.trace_codec = state.gen.codec
    return GenerationResponse(state.worker, job, renderer, req.stream)


def _model_entry(state: ServerState) -> dict:
    m = state.gen.manifest
    return {
        "id": state.model,
        "object": "model",
        "created": state.created,
        "owned_by": "specexport",
        "max_model_len": m.max_context,
        "specexport": {
            "default_proposer": state.default_proposer,
            "has_draft": state.gen.draft is not None,
            "contract_version": m.contract_version,
        },
    }


async def models(request: Request):
    state = _state(request)
    state.authorize(request)
    return JSONResponse({"object": "list", "data": [_model_entry(state)]})


async def model(request: Request):
    state = _state(request)
    state.authorize(request)
    check_model(request.path_params["model"], state.model)
    return JSONResponse(_model_entry(state))


async def health(request: Request):
    state, worker = _state(request), _state(request).worker
    body = {
        "status": "draining" if worker.draining else "ok",
        "model": state.model,
        "waiting": worker.waiting,
        "running": worker.running,
    }
    return JSONResponse(body, status_code=503 if worker.draining else 200)


async def metrics(request: Request):
    state = _state(request)
    state.authorize(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


# --- errors --------------------------------------------------------------------------------------
async def _api_error(request: Request, exc: ApiError):
    state = _state(request)
    state.metrics.rejected.labels(state.model, exc.code or str(exc.status)).inc()
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException):
    if exc.status_code == 404:
        error = ApiError(404, f"no such endpoint: {request.method} {request.url.path}", NOT_FOUND, None, "not_found")
    elif exc.status_code == 405:
        error = ApiError(
            405,
            f"{request.method} is not allowed on {request.url.path}",
            INVALID_REQUEST,
            None,
            "method_not_allowed",
            dict(exc.headers or {}),
        )
    else:
        error = ApiError(exc.status_code, str(exc.detail), INVALID_REQUEST, None, None, dict(exc.headers or {}))
    return await _api_error(request, error)


async def _internal_error(request: Request, exc: Exception):
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    error = ApiError(500, f"internal server error: {type(exc).__name__}", SERVER, None, "internal_error")
    return JSONResponse(error.body(), status_code=500)


def create_app(gen, config: ServerConfig) -> Starlette:
    """The ASGI app serving `gen` (a SpecGenerator); its worker thread runs while the app's lifespan does."""
    state = ServerState(gen, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.worker.stop, CUT_GRACE_SECONDS)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *([Route("/", web_page, methods=["GET"])] if config.web_page else []),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(
        routes=routes,
        exception_handlers=handlers,
        lifespan=lifespan,
        middleware=[Middleware(CorsMiddleware, patterns=config.cors_origins)],
    )
    app.state.server = state
    return app


# --- the response of a generation ----------------------------------------------------------------
async def _disconnected(receive) -> None:
    """Returns when the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class GenerationResponse:
    """ASGI response of one queued job: a JSON body or an SSE stream. Headers go out when the job
    starts, so a job that fails in the queue (timeout, shutdown) still answers with its status."""

    def __init__(self, worker: Worker, job: Job, renderer: Renderer, stream: bool):
        self.worker, self.job, self.renderer, self.stream = worker, job, renderer, stream

    async def __call__(self, scope, receive, send) -> None:
        respond = asyncio.ensure_future(self._stream(send) if self.stream else self._whole(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((respond, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not respond.done():  # the client left (or the server is cancelling this response)
                self.worker.cancel(self.job)
                respond.cancel()
            watch.cancel()
            await asyncio.gather(respond, watch, return_exceptions=True)
        if not respond.cancelled() and respond.exception() is not None:
            raise respond.exception()

    async def _whole(self, send) -> None:
        text: list[str] = []
        tokens: list[int] = []
        logprobs: list[dict] = []
        while True:
            event = await self.job.next_event()
            if isinstance(event, Round):
                text.append(event.text)
                tokens += event.tokens
                logprobs += event.logprobs
            elif isinstance(event, Finished):
                body = self.renderer.completion("".join(text), tokens, event.outcome, logprobs)
                await _send_json(send, 200, body, {"x-request-id": self.job.id})  # the log line's id
                return
            elif isinstance(event, Failed):
                await _send_json(send, event.error.status, event.error.body(), event.error.headers)
                return

    async def _stream(self, send) -> None:
        event = await self.job.next_event()
        if isinstance(event, Failed):
            await _send_json(send, event.error.status, event.error.body(), event.error.headers)
            return
        if not isinstance(event, Started):  # the worker posts Started before any round
            raise TypeError(f"job {self.job.id}: expected Started first, got {type(event).__name__}")
        try:
            headers = [*SSE_HEADERS, (b"x-request-id", self.job.id.encode())]  # the log line's id
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            role = self.renderer.role_chunk()
            if role:
                await send({"type": "http.response.body", "body": role, "more_body": True})
            while True:
                event = await self.job.next_event()
                if isinstance(event, Round):
                    chunk = self.renderer.content_chunk(event.text, event.tokens, event.logprobs, event.kinds)
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    continue
                if isinstance(event, Finished):
                    tail = self.renderer.final_chunks(event.outcome) + DONE
                else:  # Failed after the stream began: an error event, as OpenAI streams send them
                    tail = sse(event.error.body()) + DONE
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
        except OSError:  # the client went away while we wrote (uvicorn's ClientDisconnected)
            self.worker.cancel(self.job)
