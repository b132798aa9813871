"""The single engine worker: one thread, requests in arrival order, cancellable jobs.

A ThreadPool of exactly one thread runs every job, so the engine is only ever touched from that
thread and jobs run first come, first served (the pool's queue is FIFO). A job whose client left
while it waited is skipped when its turn comes; one whose client leaves while it runs sees
`cancelled` become true and the generator stops at the next token.
"""

from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool


class Job:
    """One request's work. `cancelled` is written in the I/O thread and read in the worker thread."""

    def __init__(self, completion, on_text=None, on_logprobs=None):
        self.completion = completion
        self.on_text = on_text
        self.on_logprobs = on_logprobs
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class EngineWorker:
    """Runs jobs on `backend` in `pool` (one thread); results come back to the reactor as Deferreds."""

    def __init__(self, reactor, backend, pool=None):
        self.reactor = reactor
        self.backend = backend
        self.pool = pool if pool is not None else ThreadPool(minthreads=1, maxthreads=1, name="krafla-engine")
        self._jobs = set()

    def start(self):
        self.pool.start()

    def stop(self):
        """Cancel every job and wait for the thread to finish the one it runs (at most one token)."""
        self.cancel_all()
        self.pool.stop()

    def submit(self, job):
        """Queue `job`; the Deferred fires with its GenerationResult, or None if it was skipped.

        This must be called in the I/O thread.
        """
        self._jobs.add(job)
        d = deferToThreadPool(self.reactor, self.pool, self._run, job)

        def forget(result):
            self._jobs.discard(job)
            return result

        return d.addBoth(forget)

    def pending(self):
        """Jobs queued or running whose client still waits (the I/O thread's view)."""
        return sum(1 for job in self._jobs if not job.cancelled)

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
        extra = {"on_logprobs": job.on_logprobs} if job.on_logprobs is not None else {}
        return self.backend.complete(job.completion, on_text=job.on_text, cancelled=lambda: job.cancelled, **extra)
