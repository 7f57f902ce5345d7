"""The one thread that runs generations, fed by a bounded FIFO queue.

Invariants:
- Only the worker thread calls into the SpecGenerator after start (its KV buffers, controllers
  and suffix store are shared by every request), so one sequence decodes at a time (a batching
  server runs batch_worker.BatchWorker instead).
- A request is queued, then running, then ended exactly once. Between rounds the worker checks
  whether the client left, the request timed out or the drain deadline passed, and then closes
  the generation's iterator: it stops within one speculative round, and an abandoned generation
  teaches the suffix store nothing (SpecGenerator.events).
- A queued request whose client left is removed from the queue at once and never runs.
- The worker talks to a request's handler through the handler's event loop only
  (call_soon_threadsafe), and stays at most MAX_BACKLOG rounds ahead of what the handler has taken:
  a streaming client that stops reading stalls its generation, and after `stall_seconds` it is
  treated as gone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import GeneratorConfig
from ..errors import SpecExportError
from .backpressure import DEFAULT_SECONDS, expected_wait, retry_headers, update_mean
from .config import ServerConfig
from .errors import RATE_LIMIT, SERVER, UNAVAILABLE, ApiError
from .logs import log_request
from .metrics import Metrics
from .responses import Outcome
from .trace import counters, round_kinds

log = logging.getLogger("specexport.server")
MAX_BACKLOG = 16  # rounds the worker may run ahead of the handler
POLL_SECONDS = 0.05  # how often a stalled worker rechecks cancellation and the drain deadline
HISTORY = 256  # ended jobs kept for inspection (tests, debugging)


@dataclass(frozen=True)
class Started:
    at: float  # time.monotonic()


@dataclass(frozen=True)
class Round:
    tokens: list[int]
    text: str
    logprobs: list[dict] = field(default_factory=list)  # per token, when the request asked (sampling.token_logprobs)
    kinds: tuple[str, ...] = ()  # per token, when the request asked for a trace (trace.py)


@dataclass(frozen=True)
class Finished:
    outcome: Outcome


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Started | Round | Finished | Failed


@dataclass(eq=False)
class Job:
    """One request's generation. Created on the handler's event loop; `inbox` is read there only."""

    prompt_ids: list[int]
    config: GeneratorConfig  # the request's, checked against the artifact by the handler
    arrived: float  # time.monotonic() when the request arrived
    deadline: float  # arrived + request timeout
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    cancelled: threading.Event = field(default_factory=threading.Event)
    credit: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(MAX_BACKLOG))
    state: str = "queued"  # queued -> running -> finished | cancelled | failed; or queued -> dropped | failed
    started: float | None = None
    ended: float | None = None
    round_times: list[float] = field(default_factory=list)  # time.monotonic() after each round
    trace: bool = False  # Round.kinds wanted (the request's `trace`)
    until: Callable[[str], bool] | None = None  # the answer so far -> it is complete (a tool call repeated)

    def post(self, event: Event) -> bool:
        """Worker thread: hand an event to the handler; False when its loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, event)
        except RuntimeError:  # the event loop closed: nobody will read this request again
            self.cancelled.set()
            return False
        return True

    async def next_event(self) -> Event:
        """Handler: the next event; taking a round gives the worker credit for one more."""
        event = await self.inbox.get()
        if isinstance(event, Round):
            self.credit.release()
        return event


class Worker:
    def __init__(self, gen, config: ServerConfig, metrics: Metrics):
        self.gen, self.config, self.metrics = gen, config, metrics
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()  # guarded by _cond
        self.current: Job | None = None  # guarded by _cond
        self._stopping = False
        self.draining = False
        self.drain_deadline = math.inf  # time.monotonic(); running jobs are cut after it
        self.history: deque[Job] = deque(maxlen=HISTORY)
        self._mean_seconds: float | None = None  # running mean of a job's run time, for Retry-After
        self._thread = threading.Thread(target=self._run, name="specexport-worker", daemon=True)

    # --- handler side (event loop thread) ----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the generating thread runs (a cluster replica's health check)."""
        return self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        with self._cond:
            return self.current is None and not self._queue

    @property
    def running(self) -> int:
        """Requests generating now."""
        return int(self.current is not None)

    @property
    def slots(self) -> int:
        """Requests that generate at once."""
        return 1

    def _full(self) -> bool:
        """The queue holds at most max_queue jobs besides the running one."""
        return len(self._queue) + (self.current is not None) > self.config.max_queue

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise ApiError 503 (draining) / 429 (queue full, with Retry-After)."""
        with self._cond:
            if self.draining or self._stopping:
                raise shutting_down()
            if self._full():
                mean = DEFAULT_SECONDS if self._mean_seconds is None else self._mean_seconds
                wait = expected_wait(mean, len(self._queue), self.slots, self.running)
                raise ApiError(
                    429,
                    f"the server is busy: {len(self._queue)} requests are waiting (--max-queue"
                    f" {self.config.max_queue}); retry later",
                    RATE_LIMIT,
                    None,
                    "queue_full",
                    retry_headers(wait),
                )
            self._queue.append(job)
            self.metrics.waiting.labels(self.metrics.model).set(len(self._queue))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client left: a queued job leaves the queue now; a running one stops after its round."""
        job.cancelled.set()
        with self._cond:
            if job.state != "queued" or job not in self._queue:
                return
            self._queue.remove(job)
            job.state, job.ended = "dropped", time.monotonic()
            self.history.append(job)
            self.metrics.waiting.labels(self.metrics.model).set(len(self._queue))
        self.metrics.cancelled.labels(self.metrics.model, "queued").inc()

    def begin_drain(self, seconds: float) -> None:
        """Refuse new jobs; fail the queued ones (503); the running one may go on for `seconds`."""
        with self._cond:
            self.draining = True
            self.drain_deadline = time.monotonic() + seconds
            queued, self._queue = list(self._queue), deque()
            self.metrics.waiting.labels(self.metrics.model).set(0)
        for job in queued:
            self._fail(job, shutting_down(), "shutdown")
            self.history.append(job)

    def stop(self, timeout: float) -> None:
        """End the thread: queued jobs fail, the running one is cut after its round."""
        self.begin_drain(0.0)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return  # stopping, nothing left
                job = self._queue.popleft()
                self.current, job.state = job, "running"
                self.metrics.waiting.labels(self.metrics.model).set(len(self._queue))
            self.metrics.running.labels(self.metrics.model).set(1)
            try:
                self._execute(job)
            except Exception as exc:  # a bug or a runtime failure: this request gets a 500, the server goes on
                log.exception("generation %s failed", job.id)
                self._fail(
                    job,
                    ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", SERVER, None, "generation_failed"),
                    "error",
                )
            finally:
                with self._cond:
                    self.current = None
                self.metrics.running.labels(self.metrics.model).set(0)
                self.history.append(job)

    def _expired(self, job: Job, now: float) -> bool:
        """Whether `job` waited in the queue past its timeout; if so it is answered 503 now."""
        if now <= job.deadline:
            return False
        self._fail(
            job,
            ApiError(
                503,
                f"the request waited {now - job.arrived:.1f} s in the queue, past the"
                f" request timeout of {self.config.request_timeout:g} s",
                UNAVAILABLE,
                None,
                "queue_timeout",
                {"Retry-After": "1"},
            ),
            "queue_timeout",
        )
        return True

    def _execute(self, job: Job) -> None:
        start = time.monotonic()
        if self._expired(job, start):
            return
        job.started = start
        job.post(Started(start))
        ttft = None
        finish, interrupted, gone = "length", None, None
        try:
            events = self.gen.events(job.prompt_ids, job.config)
        except SpecExportError as exc:  # prompt and config checked by the handler already: a bug if this happens
            self._fail(job, ApiError(400, str(exc), param="prompt", code="invalid_value"), "invalid")
            return
        delivered = 0  # tokens handed over: the offset of the next round's logprobs
        answer = ""  # the text so far, when job.until reads it
        mark = counters(events.stats)
        try:
            for tokens, text, reason in events:
                now = time.monotonic()
                if ttft is None:
                    ttft = now - job.arrived
                job.round_times.append(now)
                finish = reason or finish
                lp = events.logprobs[delivered : delivered + len(tokens)] if events.logprobs is not None else []
                delivered += len(tokens)
                kinds: tuple[str, ...] = ()
                if job.trace:
                    kinds, mark = tuple(round_kinds(mark, counters(events.stats), len(tokens))), counters(events.stats)
                gone = self._deliver(job, Round(tokens, text, lp, kinds))
                if gone:
                    break
                if job.until is not None and reason is None:
                    answer += text
                    if job.until(answer):  # complete before the model's own end: stop it here
                        finish = "stop"
                        break
                if reason is None:  # after the last round the iterator must run out, so the proposer learns
                    if job.cancelled.is_set():
                        gone = "running"
                        break
                    interrupted = self._cut(job)
                    if interrupted:
                        break
        except SpecExportError as exc:  # an option the handler could not check; nothing else is expected
            self._fail(job, ApiError(400, str(exc), code="invalid_value"), "invalid")
            return
        finally:
            events.close()  # abandons the generation when we broke out (no-op when it ran to its end)
        end = time.monotonic()
        job.ended = end
        self._mean_seconds = update_mean(self._mean_seconds, end - start)
        stats = events.stats  # this generation's own (SpecGenerator.events)
        self.metrics.record_generation(stats, start - job.arrived, ttft, end - job.arrived)
        if gone:
            job.state = "cancelled"
            self.metrics.cancelled.labels(self.metrics.model, gone).inc()
            return
        job.state = "finished"
        proposer = job.config.proposer if job.config.speculating else "none"
        outcome = Outcome(
            finish,
            stats,
            proposer,
            events.gamma_policy,
            job.config.gamma,
            start - job.arrived,
            ttft,
            interrupted,
            events.config.tree_nodes or 0,
            events.tree_policy,
        )
        log_request(job, outcome)
        self.metrics.success.labels(
            self.metrics.model, outcome.openai_finish_reason if not interrupted else interrupted
        ).inc()
        job.post(Finished(outcome))

    def _deliver(self, job: Job, event: Round) -> str | None:
        """Post a round once the handler has credit for it; the cancel stage when the client is gone."""
        stall_end = time.monotonic() + self.config.stall_seconds
        while not job.credit.acquire(timeout=POLL_SECONDS):
            if job.cancelled.is_set():
                return "running"
            if time.monotonic() > stall_end or time.monotonic() > self.drain_deadline:
                return "stalled"
        if job.cancelled.is_set() or not job.post(event):
            return "running"
        return None

    def _cut(self, job: Job) -> str | None:
        """Why the running job must stop now, if it must: 'timeout' or 'shutdown'."""
        now = time.monotonic()
        if now > self.drain_deadline:
            return "shutdown"
        if now > job.deadline:
            return "timeout"
        return None

    def _fail(self, job: Job, error: ApiError, reason: str) -> None:
        job.state, job.ended = "failed", time.monotonic()
        self.metrics.failed.labels(self.metrics.model, reason).inc()
        job.post(Failed(error))


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down; retry on another instance or after it restarts",
        UNAVAILABLE,
        None,
        "shutting_down",
        {"Retry-After": "5"},
    )
