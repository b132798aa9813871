"""The engine worker with a real ThreadPool: exactly one thread, jobs in arrival order, skipped when cancelled."""

import threading
import time
import unittest

from krafla_twisted.api.worker import EngineWorker, Job
from tests.support.fake_backend import ThreadlessReactor


class RecordingBackend:
    """Records which thread ran each job, and how many ran at once."""

    def __init__(self):
        self.runs = []
        self.running = 0
        self.most_at_once = 0
        self.lock = threading.Lock()

    def complete(self, completion, on_text, cancelled):
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(0.01)
        self.runs.append((completion, threading.get_ident()))
        with self.lock:
            self.running -= 1
        return completion


def job(value):
    """A job that hands `value` to the backend as its completion."""
    return Job(lambda backend, cancelled: backend.complete(value, None, cancelled))


class EngineWorkerTests(unittest.TestCase):
    def test_one_thread_in_order(self):
        """Twenty jobs run one at a time, in submission order, all on one thread that is not the caller's."""
        backend = RecordingBackend()
        worker = EngineWorker(ThreadlessReactor(), backend)
        self.assertEqual((worker.pool.min, worker.pool.max), (1, 1))
        worker.start()
        done = threading.Event()
        results = []
        try:
            for index in range(20):
                d = worker.submit(job(index))
                d.addCallback(results.append)
            worker.submit(job("last")).addCallback(lambda _: done.set())
            self.assertTrue(done.wait(30))
        finally:
            worker.stop()
        self.assertEqual([completion for completion, _ in backend.runs], list(range(20)) + ["last"])
        self.assertEqual(results, list(range(20)))
        threads = {ident for _, ident in backend.runs}
        self.assertEqual(len(threads), 1)
        self.assertNotIn(threading.get_ident(), threads)
        self.assertEqual(backend.most_at_once, 1)

    def test_cancelled_job_skipped(self):
        """A job cancelled while a running one holds the thread is never given to the backend; its Deferred fires with None."""
        gate = threading.Event()

        class GatedBackend(RecordingBackend):
            def complete(self, completion, on_text, cancelled):
                gate.wait(30)
                return super().complete(completion, on_text, cancelled)

        backend = GatedBackend()
        worker = EngineWorker(ThreadlessReactor(), backend)
        worker.start()
        outcome = threading.Event()
        results = []
        try:
            worker.submit(job("first"))
            skipped = job("skipped")
            worker.submit(skipped).addCallback(lambda result: (results.append(result), outcome.set()))
            skipped.cancel()
            gate.set()
            self.assertTrue(outcome.wait(30))
        finally:
            worker.stop()
        self.assertEqual(results, [None])
        self.assertEqual([completion for completion, _ in backend.runs], ["first"])


class QueueLogTests(unittest.TestCase):
    def test_log_queue_says_each_change(self):
        """With log_queue (--log-queue) every job joining and leaving the queue logs `queue: N pending`,
        N as pending() counts it then, and each job the worker takes up logs `queue: a job started`;
        without it the worker logs nothing."""
        from twisted.logger import capturedLogs, formatEvent

        gate = threading.Event()

        class GatedBackend(RecordingBackend):
            def complete(self, completion, on_text, cancelled):
                gate.wait(30)
                return super().complete(completion, on_text, cancelled)

        for log_queue, expected in ((True, ["queue: 1 pending", "queue: 2 pending", "queue: 1 pending", "queue: 0 pending"]),
                                    (False, [])):
            worker = EngineWorker(ThreadlessReactor(), GatedBackend(), log_queue=log_queue)
            worker.start()
            done = threading.Event()
            try:
                with capturedLogs() as events:
                    worker.submit(job("first"))
                    worker.submit(job("second")).addCallback(lambda _: done.set())
                    gate.set()
                    self.assertTrue(done.wait(30))
            finally:
                worker.stop()
                gate.clear()
            lines = [formatEvent(event) for event in events if event.get("log_namespace") == "krafla.queue"]
            self.assertEqual([line for line in lines if "pending" in line], expected)
            self.assertEqual(lines.count("queue: a job started"), 2 if log_queue else 0)
            self.assertEqual(len(lines), len(expected) + (2 if log_queue else 0))


class FakeGeneration:
    """Stands for a generate.Generation: ends after `steps` scheduler steps, or when cancelled."""

    def __init__(self, name, steps, cancelled):
        self.name, self.steps, self.cancelled = name, steps, cancelled
        self.slot = None
        self.result = None
        self.error = None
        self.skipped = False


class CountingScheduler:
    """A scheduler of FakeGenerations with `parallel` slots; `log` records each step's members and
    each plain job, in the order the worker thread ran them."""

    def __init__(self, log, parallel=2):
        self.log, self.parallel = log, parallel
        self.waiting, self.active = [], []

    @property
    def busy(self):
        return bool(self.waiting or self.active)

    def add(self, generation):
        self.waiting.append(generation)

    def step(self):
        ended = [g for g in self.waiting if g.cancelled()]
        self.waiting = [g for g in self.waiting if g not in ended]
        for generation in ended:
            generation.skipped = True
        while self.waiting and len(self.active) < self.parallel:
            generation = self.waiting.pop(0)
            generation.slot = "slot"
            self.active.append(generation)
        self.log.append(("step", tuple(g.name for g in self.active)))
        for generation in list(self.active):
            generation.steps -= 1
            if generation.steps <= 0 or generation.cancelled():
                generation.result = generation.name
                self.active.remove(generation)
                ended.append(generation)
        return ended


class SchedulingBackend:
    def __init__(self, log):
        self.scheduler = CountingScheduler(log)


class ScheduledWorkerTests(unittest.TestCase):
    def test_generations_step_together_and_jobs_run_between_steps(self):
        """Completions handed to the scheduler (scheduler.Pending) run side by side in its steps; a plain job
        (/tokenize) submitted while they step runs between two steps, not after the replies; each Deferred
        fires with its conclude()'s result; a generation cancelled while it waits for a slot fires with None."""
        from krafla_twisted.generation.scheduler import Pending

        log, results = [], {}
        backend = SchedulingBackend(log)
        second_step, tokenize_sent = threading.Event(), threading.Event()
        step = backend.scheduler.step

        def step_and_pause():
            ended = step()
            if sum(kind == "step" for kind, _ in log) == 2:
                second_step.set()
                tokenize_sent.wait(30)  # the worker thread holds here until the plain job is queued
            return ended

        backend.scheduler.step = step_and_pause

        def pending(name, steps, cancelled=lambda: False):
            generation = FakeGeneration(name, steps, cancelled)
            return Job(lambda backend, is_cancelled: Pending(generation, lambda g: f"{g.result} done"))

        worker = EngineWorker(ThreadlessReactor(), backend)
        done = threading.Semaphore(0)

        def submit(name, job):
            worker.submit(job).addCallback(lambda result: results.__setitem__(name, result)).addBoth(
                lambda _: done.release())

        worker.start()
        try:
            submit("first", pending("first", 6))
            submit("second", pending("second", 3))
            submit("third", pending("third", 1, cancelled=lambda: True))
            self.assertTrue(second_step.wait(30))
            submit("tokenize", Job(lambda backend, cancelled: log.append(("job", "tokenize")) or "tokens"))
            tokenize_sent.set()
            for _ in range(4):
                self.assertTrue(done.acquire(timeout=30))
        finally:
            worker.stop()
        self.assertEqual(results, {"first": "first done", "second": "second done", "third": None, "tokenize": "tokens"})
        self.assertIn(("step", ("first", "second")), log)
        job_at = log.index(("job", "tokenize"))
        self.assertEqual([kind for kind, _ in log[:job_at]], ["step", "step"], log)
        self.assertIn(("step", ("first",)), log[job_at + 1:])
