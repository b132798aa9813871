"""The single engine worker: one thread, requests in arrival order, cancellable jobs.

A ThreadPool of exactly one thread runs every job, so the engine (model, session and tokenizer)
is only ever touched from that thread and jobs run first come, first served (the pool's queue is
FIFO): completions, /tokenize and /detokenize alike, all inside --max-queue. A job whose client
left while it waited is skipped when its turn comes; one whose client leaves while it runs sees
`cancelled` become true and the generator stops at the next token.
"""

from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

log = Logger(namespace="krafla.queue")


class Job:
    """One request's work: `work(backend, cancelled)` runs in the worker thread and returns the
    result; `cancelled()` says whether the client left. `cancelled` is written in the I/O thread and
    read in the worker thread."""

    def __init__(self, work):
        self.work = work
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class EngineWorker:
    """Runs jobs on `backend` in `pool` (one thread); results come back to the reactor as Deferreds.

    With `log_queue` (--log-queue), a line `queue: N pending` is logged whenever a job joins the
    queue or leaves it, so an operator (or a test) can watch the queue without polling /metrics."""

    def __init__(self, reactor, backend, pool=None, log_queue=False):
        self.reactor = reactor
        self.backend = backend
        self.pool = pool if pool is not None else ThreadPool(minthreads=1, maxthreads=1, name="krafla-engine")
        self.log_queue = log_queue
        self._jobs = set()

    def start(self):
        self.pool.start()

    def stop(self):
        """Cancel every job and wait for the thread to finish the one it runs (at most one token)."""
        self.cancel_all()
        self.pool.stop()

    def submit(self, job):
        """Queue `job`; the Deferred fires with its result, or None if it was skipped.

        This must be called in the I/O thread.
        """
        self._jobs.add(job)
        self._queue_changed()
        d = deferToThreadPool(self.reactor, self.pool, self._run, job)

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

    def _run(self, job):
        # Runs in the worker thread.
        if job.cancelled:
            return None
        return job.work(self.backend, lambda: job.cancelled)
