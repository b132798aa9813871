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
        N as pending() counts it then; without it the worker logs nothing."""
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
            self.assertEqual(lines, expected)
