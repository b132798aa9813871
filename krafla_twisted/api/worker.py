"""The single engine worker: one thread, requests in arrival order, cancellable jobs.

A ThreadPool of exactly one thread runs every job, so the engine (model, sessions and tokenizer)
is only ever touched from that thread and jobs start first come, first served (the pool's queue is
FIFO): completions, /tokenize and /detokenize alike, all inside --max-queue. A job whose client
left while it waited is skipped when its turn comes; one whose client leaves while it runs sees
`cancelled` become true and its generation stops before the next step.

A completion's job does not run its reply to the end: it returns a scheduler.Pending, which joins
the backend's Scheduler (krafla_twisted/generation/scheduler.py; --parallel slots). Between jobs, while no
other job waits in the pool, the thread runs the scheduler's forward steps, each over every active
reply; a job that comes in runs between two steps (a new completion joins the batch at the next
one). A backend without a scheduler answers each job at once.
"""

import threading

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from krafla_twisted.generation.scheduler import Pending

log = Logger(namespace="krafla.queue")


class Job:
    """One request's work: `work(backend, cancelled)` runs in the worker thread and returns the
    result (or a scheduler.Pending); `cancelled()` says whether the client left. `cancelled` is
    written in the I/O thread and read in the worker thread."""

    def __init__(self, work):
        self.work = work
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class EngineWorker:
    """Runs jobs on `backend` in `pool` (one thread); results come back to the reactor as Deferreds.

    With `log_queue` (--log-queue), a line `queue: N pending` is logged whenever a job joins the
    queue or leaves it, and `queue: a job started` when the worker thread takes one up (from then on
    a completion's prompt is read and a cancel stops it there), so an operator (or a test) can watch
    the queue without polling /metrics."""

    def __init__(self, reactor, backend, pool=None, log_queue=False):
        self.reactor = reactor
        self.backend = backend
        self.pool = pool if pool is not None else ThreadPool(minthreads=1, maxthreads=1, name="krafla-engine")
        self.log_queue = log_queue
        self.scheduler = getattr(backend, "scheduler", None)
        self._jobs = set()
        self._lock = threading.Lock()
        self._queued = 0        # jobs handed to the pool and not yet started
        self._running = {}      # generation -> (job's Deferred, its Pending); worker thread only

    def start(self):
        self.pool.start()

    def stop(self):
        """Cancel every job and wait for the thread to finish what it runs (at most one step)."""
        self.cancel_all()
        self.pool.stop()

    def submit(self, job):
        """Queue `job`; the Deferred fires with its result, or None if it was skipped.

        This must be called in the I/O thread.
        """
        self._jobs.add(job)
        self._queue_changed()
        d = Deferred()
        with self._lock:
            self._queued += 1
        self.pool.callInThreadWithCallback(self._ran, self._run, job, d)

        def forget(result):
            self._jobs.discard(job)
            self._queue_changed()
            return result

        return d.addBoth(forget)

    def pending(self):
        """Jobs queued or running whose client still waits (the I/O thread's view)."""
        return sum(1 for job in self._jobs if not job.cancelled)

    def _queue_changed(self):
        if self.log_queue:
            log.info("queue: {pending} pending", pending=self.pending())

    def cancel_all(self):
        for job in list(self._jobs):
            job.cancel()

    def call_in_reactor(self, function, *args):
        """Run function(*args) in the I/O thread; this is how the worker thread reaches requests."""
        self.reactor.callFromThread(function, *args)

    def _run(self, job, d):
        # Runs in the worker thread: start the job, then step the scheduler until another job waits.
        with self._lock:
            self._queued -= 1
        self._start(job, d)
        scheduler = self.scheduler
        while scheduler is not None and scheduler.busy and not self._queued:
            try:
                ended = scheduler.step()
            except Exception as e:  # a bug: every reply in the batch ends with it rather than hang
                log.failure("a forward step failed")
                ended = scheduler.abandon(e)
            for generation in ended:
                d, pending = self._running.pop(generation)
                if generation.skipped:  # cancelled while it waited for a slot: skipped, as a queued job is
                    self.call_in_reactor(d.callback, None)
                else:
                    self._conclude(d, lambda: pending.conclude(generation))

    def _start(self, job, d):
        if job.cancelled:
            self.call_in_reactor(d.callback, None)
            return
        if self.log_queue:
            self.call_in_reactor(log.info, "queue: a job started")
        try:
            outcome = job.work(self.backend, lambda: job.cancelled)
        except Exception:
            self.call_in_reactor(d.errback, Failure())
            return
        if isinstance(outcome, Pending):
            self._running[outcome.generation] = (d, outcome)
            self.scheduler.add(outcome.generation)
        else:
            self.call_in_reactor(d.callback, outcome)

    def _conclude(self, d, conclude):
        try:
            result = conclude()
        except Exception:
            self.call_in_reactor(d.errback, Failure())
        else:
            self.call_in_reactor(d.callback, result)

    def _ran(self, success, result):
        # Worker thread: _run catches each job's errors, so a failure here is a bug in the worker.
        if not success:
            log.failure("the engine worker failed", result)
