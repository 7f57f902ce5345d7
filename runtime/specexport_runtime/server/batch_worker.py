"""The worker of a batching server (`serve --max-batch N`): one thread runs up to N generations at
once on the batch scheduler (batch.py); the queue, 429, timeouts, drain and cancellation are the
batch-1 worker's (worker.py), per request.

Invariants (besides worker.py's):
- Requests join the scheduler at round boundaries, first come first served, while fewer than N
  run; one that finishes, is cancelled, times out or is cut by the drain leaves at the next
  boundary, and its slot is free for a waiting request in that same round.
- A slow streaming client never holds up the others: a round it has no credit for stays in its
  own backlog (MAX_BACKLOG rounds), and a client that takes nothing for stall_seconds is treated
  as gone; its sequence is cancelled.
- A failure of the shared batch call fails every running request (500) and starts a fresh
  scheduler; queued requests go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..batch import BatchSequence
from ..errors import SpecExportError
from ..generator import FINISH_REASONS
from .backpressure import update_mean
from .config import ServerConfig
from .errors import SERVER, ApiError
from .logs import log_request
from .metrics import Metrics
from .responses import Outcome
from .trace import counters, round_kinds
from .worker import Finished, Job, Round, Started, Worker

log = logging.getLogger("specexport.server")


@dataclass(eq=False)
class Running:
    """A job in the scheduler and what has been handed to its handler."""

    job: Job
    seq: BatchSequence
    start: float
    ttft: float | None = None
    sent_tokens: int = 0
    sent_pieces: int = 0
    backlog: deque = field(default_factory=deque)  # rounds not yet posted (no credit)
    stalled_since: float | None = None
    mark: tuple = (0, 0, 0, 0, 0)  # trace.counters after the last collected round
    answer: str = ""  # the text so far, when job.until reads it
    finish: str | None = None  # set when job.until ended the answer before the sequence did


class BatchWorker(Worker):
    """Worker's interface (submit, cancel, begin_drain, stop, waiting, idle) over a BatchScheduler."""

    def __init__(self, gen, config: ServerConfig, metrics: Metrics, max_batch: int):
        super().__init__(gen, config, metrics)
        self.max_batch = max_batch
        self.scheduler = gen.scheduler(max_running=max_batch)
        self.active: dict[int, Running] = {}  # sequence id -> its job; worker thread only
        self._running = 0  # len(self.active), readable from the handlers' thread
        self._thread = threading.Thread(target=self._run, name="specexport-batch-worker", daemon=True)

    @property
    def running(self) -> int:
        return self._running

    @property
    def slots(self) -> int:
        return self.max_batch

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._running and not self._queue

    def _full(self) -> bool:
        """The queue holds at most max_queue requests besides those the free slots will take."""
        return len(self._queue) >= self.config.max_queue + max(0, self.max_batch - self._running)

    # --- worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self.active and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self.active:
                    return
                joining = []
                while self._queue and len(self.active) + len(joining) < self.max_batch:
                    joining.append(self._queue.popleft())
                self.metrics.waiting.labels(self.metrics.model).set(len(self._queue))
            for job in joining:
                self._join(job)
            self._boundary()
            if not self.active:
                continue
            self.metrics.observe_batch(len(self.active))
            try:
                touched = self.scheduler.step()
            except Exception as exc:  # the shared call failed: every running request gets a 500
                log.exception("batched round failed")
                error = ApiError(
                    500, f"generation failed: {type(exc).__name__}: {exc}", SERVER, None, "generation_failed"
                )
                for run in list(self.active.values()):
                    self._end(run, failed=error)
                self.scheduler = self.gen.scheduler(max_running=self.max_batch)
                continue
            for seq in touched:
                run = self.active.get(seq.id)
                if run is not None:
                    self._collect(run)
            self._flush()

    def _join(self, job: Job) -> None:
        start = time.monotonic()
        if self._expired(job, start):
            return
        try:
            seq = self.scheduler.submit(job.prompt_ids, job.config)
        except SpecExportError as exc:  # checked by the handler already: a bug if this happens
            self._fail(job, ApiError(400, str(exc), param="prompt", code="invalid_value"), "invalid")
            return
        job.state, job.started = "running", start
        job.post(Started(start))
        self.active[seq.id] = Running(job, seq, start)
        self._running = len(self.active)
        self.metrics.running.labels(self.metrics.model).set(self._running)

    def _boundary(self) -> None:
        """Between rounds: cancelled, timed-out, stalled and drained requests leave."""
        now = time.monotonic()
        for run in list(self.active.values()):
            if run.job.cancelled.is_set():
                self._end(run, gone="running")
            elif run.stalled_since is not None and now - run.stalled_since > self.config.stall_seconds:
                self._end(run, gone="stalled")
            elif not run.seq.done and (why := self._cut(run.job)):
                self._end(run, interrupted=why)

    def _collect(self, run: Running) -> None:
        """The tokens and text the sequence emitted since the last round, as one Round."""
        seq = run.seq
        tokens, pieces = seq.tokens[run.sent_tokens :], seq.pieces[run.sent_pieces :]
        logprobs = getattr(seq._loop, "logprobs", None)
        lp = logprobs[run.sent_tokens : run.sent_tokens + len(tokens)] if logprobs is not None else []
        if tokens or pieces:
            now = time.monotonic()
            run.job.round_times.append(now)
            if run.ttft is None and tokens:
                run.ttft = now - run.job.arrived
            kinds: tuple[str, ...] = ()
            if run.job.trace and seq.stats is not None:
                now_counts = counters(seq.stats)
                kinds, run.mark = tuple(round_kinds(run.mark, now_counts, len(tokens))), now_counts
            run.backlog.append(Round(tokens, "".join(pieces), lp, kinds))
            if run.job.until is not None and not seq.done and run.finish is None:
                run.answer += "".join(pieces)
                if run.job.until(run.answer):  # complete before the model's own end: it leaves now
                    run.finish = "stop"
        run.sent_tokens, run.sent_pieces = len(seq.tokens), len(seq.pieces)

    def _flush(self) -> None:
        """Post what each handler has credit for; finish the sequences that are done."""
        now = time.monotonic()
        for run in list(self.active.values()):
            while run.backlog and run.job.credit.acquire(blocking=False):
                if run.job.cancelled.is_set() or not run.job.post(run.backlog.popleft()):
                    self._end(run, gone="running")
                    break
            if run.job.state != "running":
                continue
            run.stalled_since = (run.stalled_since or now) if run.backlog else None
            if run.finish is not None or (run.seq.done and not run.backlog):
                self._end(run)  # posts what is left of the backlog

    def _end(
        self, run: Running, gone: str | None = None, interrupted: str | None = None, failed: ApiError | None = None
    ) -> None:
        job, seq = run.job, run.seq
        if not seq.done:
            self.scheduler.cancel(seq)
        self.active.pop(seq.id, None)
        self._running = len(self.active)
        self.metrics.running.labels(self.metrics.model).set(self._running)
        end = time.monotonic()
        job.ended = end
        self.history.append(job)
        if failed is not None:
            self._fail(job, failed, "error")
            return
        if seq.stats is not None:
            self.metrics.record_generation(seq.stats, run.start - job.arrived, run.ttft, end - job.arrived)
        self._mean_seconds = update_mean(self._mean_seconds, end - run.start)
        if gone:
            job.state = "cancelled"
            self.metrics.cancelled.labels(self.metrics.model, gone).inc()
            return
        for event in run.backlog:  # the end of the answer is never dropped, credit or not
            job.post(event)
        run.backlog.clear()
        job.state = "finished"
        finish = run.finish or (
            seq.finish_reason if seq.finish_reason in FINISH_REASONS else "length"
        )  # cut: "cancelled"
        proposer = seq.proposer if job.config.speculating else "none"
        outcome = Outcome(
            finish, seq.stats, proposer, "batch", job.config.gamma, run.start - job.arrived, run.ttft, interrupted
        )
        log_request(job, outcome)
        self.metrics.success.labels(
            self.metrics.model, outcome.openai_finish_reason if not interrupted else interrupted
        ).inc()
        job.post(Finished(outcome))
