"""Several models in one server (`twistd krafla --models FILE` or `--models-dir DIR`): the registry
that loads and unloads them, and the resources that route each request to its model.

    registry = Registry(specs, load, serve, reactor, idle_unload=300, max_memory=budget)
    install(front_root, registry)     # the route table's model endpoints go through the registry

A request's `model` field names the model (a spec's name or one of its aliases; a request without
one goes to the first model). A model is loaded on its first request, in the registry's own
loading thread (never the reactor's), one load at a time: two requests for a model that is loading
wait for the same load. A loaded model is a `Served`: its Backend, its own EngineWorker (one thread,
its own --parallel slots, so a slow model never stalls another) and its own resource tree
(krafla_twisted/api/routes.py), to which the request is handed whole.

A model is unloaded when it has served no request for `idle_unload` seconds, or when the next load
would take the server's resident memory past `max_memory`: then the least recently used models
with no request running go first. A model whose request is running is never unloaded; a load that
cannot fit until one of them ends waits for it. A model whose load failed is `failed`: its
requests get a 503 with the load's error, the other models keep serving. It is loaded again on the
first request after its files change (their size or modification time: the file was fixed or
replaced), or after `retry_failed` seconds (LOAD_RETRY_SECONDS) on the registry's clock.

Everything here runs in the I/O thread except `load`, which runs in the loading thread.
"""

import collections
import hashlib
import json
import os
from urllib.parse import unquote

from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from twisted.web.resource import getChildForRequest
from twisted.web.server import NOT_DONE_YET

from krafla_twisted.api.anthropic import AnthropicErrors
from krafla_twisted.api.errors import APIError, NotFound
from krafla_twisted.api.ollama import NEVER, OllamaErrors, model_facts, parameter_size, rfc3339
from krafla_twisted.api.resources import API, APIResource, Endpoint, error_response, json_response
from krafla_twisted.api.routes import build_root
from krafla_twisted.api.site import REQUEST_DEADLINE_SECONDS
from krafla_twisted.api.worker import EngineWorker

log = Logger(namespace="krafla.models")

UNLOADED, LOADING, LOADED, FAILED = "unloaded", "loading", "loaded", "failed"
DEFAULT_IDLE_UNLOAD = 300.0   # --idle-unload's default, seconds
LOAD_WAIT_SECONDS = REQUEST_DEADLINE_SECONDS   # how long a request waits for its model's load
LOAD_RETRY_SECONDS = 30.0   # a failed model is loaded again on a request this long after it failed

# The endpoints whose body names a model, under / and /v1; Ollama's under /api.
MODEL_PATHS = ((b"chat", b"completions"), (b"completions",), (b"messages",), (b"responses",), (b"embeddings",),
               (b"rerank",), (b"reranking",), (b"tokenize",), (b"detokenize",))
OLLAMA_MODEL_PATHS = (b"chat", b"generate", b"embed", b"embeddings", b"show")


class ModelLoadFailed(APIError):
    status = 503

    def __init__(self, name, reason, retry_seconds=None):
        again = "" if retry_seconds is None else (f" (it is loaded again once its file changes, or on a request "
                                                  f"{retry_seconds:g} s after the failure)")
        super().__init__(f"The model '{name}' could not be loaded: {reason}{again}", param="model",
                         code="model_load_failed")


class ModelStillLoading(APIError):
    status = 503

    def __init__(self, name, seconds):
        super().__init__(f"The model '{name}' did not finish loading within {seconds} seconds", param="model",
                         code="model_loading", headers=[(b"retry-after", b"5")])


def model_not_found(name):
    return NotFound(f"The model '{name}' does not exist", param="model", code="model_not_found")


def file_stamps(spec):
    """(size, modification time in ns) of a spec's model file and tokenizer, None for one that cannot
    be read: what tells a fixed file from the one whose load failed."""
    stamps = []
    for path in (spec.path, spec.tokenizer):
        try:
            stat = os.stat(path) if path else None
        except OSError:
            stat = None
        stamps.append(None if stat is None else (stat.st_size, stat.st_mtime_ns))
    return tuple(stamps)


def resident_bytes():
    """This process's resident memory (VmRSS of /proc/self/status), or 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Served:
    """A loaded model: its runtime, Backend, EngineWorker (started), API and resource tree."""

    def __init__(self, runtime, backend, access, reactor, *, max_queue, stored_responses, log_queue=False):
        self.runtime = runtime
        self.backend = backend
        self.worker = EngineWorker(reactor, backend, log_queue=log_queue)
        self.worker.start()
        self.api = API(backend, self.worker, access, reactor, max_queue=max_queue)
        self.root = build_root(self.api, stored_responses=stored_responses)

    def close(self):
        """End what runs (a stop: replies end with an error), stop the thread, free the model."""
        self.api.shutdown()
        self.worker.stop()
        self.runtime.close()


class Entry:
    """One model of the registry and its state (I/O thread only)."""

    def __init__(self, spec):
        self.spec = spec
        self.name = spec.name
        self.state = UNLOADED
        self.error = None
        self.failed_at = None    # the registry clock's time of the last failed load
        self.load_files = None   # file_stamps(spec) as the last load began (a failed load: what it read)
        self.served = None
        self.waiters = []        # Deferreds of requests waiting for the load
        self.active = 0          # requests routed to it and not finished
        self.last_used = 0.0
        self.idle_call = None

    def estimate(self):
        """The resident memory its load may take at its peak (cli/registry.memory_estimate)."""
        return self.spec.estimate


class Registry:
    """The models of a --models server. `load(spec)` (run in the loading thread) returns the loaded
    (runtime, backend); `serve(spec, runtime, backend)` (I/O thread) returns its Served. `resident`
    gives the process's resident bytes (the memory budget is checked against it)."""

    def __init__(self, specs, load, serve, reactor, *, idle_unload=DEFAULT_IDLE_UNLOAD, max_memory=None,
                 resident=resident_bytes, pool=None, retry_failed=LOAD_RETRY_SECONDS):
        self.entries = [Entry(spec) for spec in specs]
        self.by_name = {}
        for entry in self.entries:
            for name in (entry.name, *entry.spec.aliases):
                self.by_name.setdefault(name, entry)
        self.load = load
        self.serve = serve
        self.reactor = reactor
        self.idle_unload = idle_unload
        self.max_memory = max_memory
        self.resident = resident
        self.retry_failed = retry_failed
        self.pool = pool if pool is not None else ThreadPool(minthreads=1, maxthreads=1, name="krafla-loader")
        self.queue = collections.deque()   # entries waiting for their turn to load
        self.loading = None
        self.stopping = False

    @property
    def default(self):
        return self.entries[0]

    def start(self):
        self.pool.start()

    def stop(self):
        """Free every loaded model; a load under way finishes in the loading thread and is freed then."""
        self.stopping = True
        for entry in self.entries:
            if entry.idle_call is not None and entry.idle_call.active():
                entry.idle_call.cancel()
            for waiter in entry.waiters:
                waiter.errback(ModelLoadFailed(entry.name, "the server is shutting down"))
            entry.waiters = []
            if entry.served is not None:
                entry.served.close()
                entry.served = None
                entry.state = UNLOADED
        self.pool.stop()

    def lookup(self, name):
        """The Entry a request's `model` names (None or "": the first model), or None if none has that name."""
        if not name:
            return self.default
        return self.by_name.get(name)

    def acquire(self, entry):
        """Count a request as running on `entry` (until `release`) and load the model if need be.
        The Deferred fires with its Served, or fails with an APIError."""
        entry.active += 1
        entry.last_used = self.reactor.seconds()
        if entry.idle_call is not None and entry.idle_call.active():
            entry.idle_call.cancel()
        entry.idle_call = None
        if entry.state == LOADED:
            return defer.succeed(entry.served)
        if entry.state == FAILED and not self.stopping:
            why = self._retry_reason(entry)
            if why is not None:
                log.info("trying the model {name} again ({why})", name=entry.name, why=why)
                entry.state = UNLOADED
        if entry.state == FAILED:
            return defer.fail(self._failure(entry))
        if self.stopping:
            return defer.fail(ModelLoadFailed(entry.name, "the server is shutting down"))
        waiter = defer.Deferred()
        entry.waiters.append(waiter)
        if entry.state == UNLOADED:
            entry.state = LOADING
            self.queue.append(entry)
            self._next_load()
        return waiter

    def release(self, entry):
        """A request on `entry` is over: an idle model's countdown starts, and a load waiting for memory may go."""
        entry.active -= 1
        entry.last_used = self.reactor.seconds()
        if entry.active == 0 and entry.state == LOADED:
            self._count_down(entry)
        self._next_load()

    def _retry_reason(self, entry):
        """Why a failed model may be loaded again now, or None while it may not."""
        if file_stamps(entry.spec) != entry.load_files:
            return "its file changed"
        if self.reactor.seconds() - entry.failed_at >= self.retry_failed:
            return f"{self.retry_failed:g} s after it failed"
        return None

    def _failure(self, entry):
        return ModelLoadFailed(entry.name, entry.error, self.retry_failed)

    def _count_down(self, entry):
        if self.idle_unload is not None and not self.stopping:
            entry.idle_call = self.reactor.callLater(self.idle_unload, self._idle, entry)

    def _idle(self, entry):
        entry.idle_call = None
        if entry.active == 0 and entry.state == LOADED:
            self._unload(entry, f"idle for {self.idle_unload:g} s")

    def _unload(self, entry, why):
        served, entry.served = entry.served, None
        entry.state = UNLOADED
        if entry.idle_call is not None and entry.idle_call.active():
            entry.idle_call.cancel()
        entry.idle_call = None
        served.close()
        log.info("unloaded model {name} ({why})", name=entry.name, why=why)

    def _make_room(self, need):
        """Unload idle models, least recently used first, until `need` more bytes fit in the budget;
        False if they cannot (models with requests running hold the rest)."""
        if self.max_memory is None:
            return True
        while self.resident() + need > self.max_memory:
            idle = [e for e in self.entries if e.state == LOADED and e.active == 0]
            if not idle:
                return False
            self._unload(min(idle, key=lambda e: e.last_used), "to make room within --max-memory")
        return True

    def _next_load(self):
        while self.loading is None and self.queue and not self.stopping:
            entry = self.queue[0]
            if entry.active == 0:  # every request for it left while it waited
                self.queue.popleft()
                entry.state = UNLOADED
                continue
            need = entry.estimate()
            if not self._make_room(need):
                busy = [e for e in self.entries if e.state == LOADED]
                if busy:
                    return  # a model with requests running holds the memory: wait for a release
                self.queue.popleft()
                entry.load_files = file_stamps(entry.spec)
                self._failed(entry, f"it needs about {need / 2**20:.0f} MiB and the server holds "
                             f"{self.resident() / 2**20:.0f} MiB already, past --max-memory "
                             f"{self.max_memory / 2**20:.0f} MiB")
                continue
            self.queue.popleft()
            self.loading = entry
            entry.load_files = file_stamps(entry.spec)
            log.info("loading model {name} from {path}", name=entry.name, path=entry.spec.path)
            d = threads.deferToThreadPool(self.reactor, self.pool, self.load, entry.spec)
            d.addCallbacks(self._loaded, self._load_failed, callbackArgs=(entry,),
                           errbackArgs=(entry,))

    def _loaded(self, loaded, entry):
        self.loading = None
        runtime, backend = loaded
        if self.stopping:
            runtime.close()
            return
        try:
            entry.served = self.serve(entry.spec, runtime, backend)
        except Exception as e:
            runtime.close()
            self._failed(entry, str(e))
            self._next_load()
            return
        entry.state = LOADED
        log.info("{banner}", banner=backend.banner())
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            waiter.callback(entry.served)
        if entry.active == 0:
            self._count_down(entry)
        self._next_load()

    def _load_failed(self, failure, entry):
        self.loading = None
        self._failed(entry, failure.getErrorMessage())
        self._next_load()

    def _failed(self, entry, reason):
        entry.state = FAILED
        entry.error = reason
        entry.failed_at = self.reactor.seconds()
        log.error("cannot load the model {name}: {reason}", name=entry.name, reason=reason)
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            waiter.errback(self._failure(entry))

    def model_object(self, entry, created):
        """The entry in /v1/models: OpenAI's fields, then its state (and aliases, and a failed load's error)."""
        out = {"id": entry.name, "object": "model", "created": created, "owned_by": "krafla", "state": entry.state,
               "aliases": list(entry.spec.aliases), "embeddings": bool(entry.spec.embeddings)}
        if entry.state == FAILED:
            out["error"] = entry.error
        return out

    def engines(self):
        """(model name, jobs pending, scheduler or None) of every loaded model: /metrics' gauges."""
        return [(e.name, e.served.worker.pending(), getattr(e.served.backend, "scheduler", None))
                for e in self.entries if e.state == LOADED]


# ---------------------------------------------------------------------------------------------
# The resources


def _delegate(root, request, segments):
    """Answer `request` with the resource at `segments` under `root`, as the Site would have found it."""
    request.prepath = []
    request.postpath = list(segments)
    return getChildForRequest(root, request).render(request)


def _write_rendered(request, body):
    """What a delegated render returned, written as the Site writes a resource's body."""
    if body is NOT_DONE_YET:
        return
    request.setHeader(b"content-length", str(len(body)).encode("ascii"))
    if request.method != b"HEAD":
        request.write(body)
    request.finish()


class ModelRoute(APIResource):
    """An endpoint whose request names a model: the request is handed to that model's own tree
    once it is loaded. `original` answers the other methods (GET /v1/responses/ID)."""

    isLeaf = True
    methods = ("POST",)
    name_fields = ("model",)

    def __init__(self, api, registry, original):
        super().__init__(api)
        self.registry = registry
        self.original = original

    def render(self, request):
        if request.method not in (b"POST", b"OPTIONS"):
            return getChildForRequest(self.original, request).render(request)
        return super().render(request)

    def render_POST(self, request):
        segments = request.prepath + request.postpath
        body = request.content.read()
        request.content.seek(0)
        try:
            fields = json.loads(body)
        except ValueError:
            fields = None  # the model's own endpoint says what is wrong with the body
        name = None
        if isinstance(fields, dict):
            name = next((fields[key] for key in self.name_fields if isinstance(fields.get(key), str) and fields[key]),
                        None)
        entry = self.registry.lookup(name)
        if entry is None:
            raise model_not_found(name)
        request.model_label = entry.name
        registry = self.registry
        state = {"gone": False, "done": False}

        def over(_):
            state["gone"] = True
            registry.release(entry)

        d = registry.acquire(entry)
        request.notifyFinish().addBoth(over)
        if d.called:  # loaded already, or failed: answer now
            outcome = []
            d.addBoth(outcome.append)
            if isinstance(outcome[0], Failure):
                outcome[0].raiseException()
            return _delegate(outcome[0].root, request, segments)

        # Loading: the request waits, at most LOAD_WAIT_SECONDS.
        def too_slow():
            state["done"] = True
            self._answer_error(request, ModelStillLoading(entry.name, LOAD_WAIT_SECONDS))

        timer = self.api.clock.callLater(LOAD_WAIT_SECONDS, too_slow)

        def loaded(served):
            if timer.active():
                timer.cancel()
            if state["gone"] or state["done"]:
                return
            try:
                _write_rendered(request, _delegate(served.root, request, segments))
            except Exception:
                log.failure("routing to {name} failed", name=entry.name)

        def failed(failure):
            if timer.active():
                timer.cancel()
            if state["gone"] or state["done"]:
                return
            error = failure.value if isinstance(failure.value, APIError) else ModelLoadFailed(entry.name, failure.value)
            self._answer_error(request, error)

        d.addCallbacks(loaded, failed)
        return NOT_DONE_YET

    def _answer_error(self, request, error):
        _write_rendered(request, error_response(request, error, self.error_body(error)))


class AnthropicModelRoute(AnthropicErrors, ModelRoute):
    pass


class OllamaModelRoute(OllamaErrors, ModelRoute):
    name_fields = ("model", "name")  # Ollama's older clients send `name`


class AllModels(APIResource):
    """GET /v1/models: every model of the registry with its state; /v1/models/ID one of them (or 404)."""

    methods = ("GET",)

    def __init__(self, api, registry, model_id=None):
        super().__init__(api)
        self.registry = registry
        self.model_id = model_id

    def render_GET(self, request):
        created = self.api.created
        if self.model_id is None:
            return json_response(request, {"object": "list", "data": [
                self.registry.model_object(entry, created) for entry in self.registry.entries]})
        entry = self.registry.by_name.get(self.model_id)
        if entry is None:
            raise model_not_found(self.model_id)
        return json_response(request, self.registry.model_object(entry, created))

    def getChild(self, path, request):
        if path == b"" and self.model_id is None:
            return self
        name = "/".join(unquote(part.decode("utf-8", "replace")) for part in [path, *request.postpath])
        request.postpath = []
        return AllModels(self.api, self.registry, name)


def _facts(entry):
    """Ollama's facts of a model: what model_facts says of a loaded one, its file's of another."""
    if entry.served is not None:
        return model_facts(entry.served.api)
    try:
        stat = os.stat(entry.spec.path)
        size, mtime, stamp = stat.st_size, stat.st_mtime, stat.st_mtime_ns
    except OSError:
        size, mtime, stamp = 0, 0, 0
    identity = f"{entry.spec.path}\0{size}\0{stamp}".encode("utf-8", "replace")
    header = getattr(entry.spec, "header", None) or {}  # cli/registry.file_header, read when the server started
    arch, n_params = header.get("arch", ""), header.get("n_params", 0)
    return {"name": entry.name, "model": entry.name, "modified_at": rfc3339(mtime), "size": size,
            "digest": hashlib.sha256(identity).hexdigest(),
            "details": {"parent_model": "", "format": os.path.splitext(entry.spec.path)[1].lstrip("."),
                        "family": arch, "families": [arch] if arch else None,
                        "parameter_size": parameter_size(n_params) if n_params else "",
                        "quantization_level": header.get("file_type", "")}}


class OllamaTags(OllamaErrors, Endpoint):
    """GET /api/tags: every model of the registry, loaded or not."""

    methods = ("GET",)

    def __init__(self, api, registry):
        super().__init__(api)
        self.registry = registry

    def render_GET(self, request):
        return json_response(request, {"models": [_facts(entry) for entry in self.registry.entries]})


class OllamaPs(OllamaTags):
    """GET /api/ps: the loaded models, each with when it unloads if it stays idle."""

    def render_GET(self, request):
        models = []
        for entry in self.registry.entries:
            if entry.state != LOADED:
                continue
            facts = _facts(entry)
            running = {key: facts[key] for key in ("name", "model", "size", "digest", "details")}
            idle = self.registry.idle_unload
            if entry.active or idle is None:
                expires = NEVER
            else:
                expires = rfc3339(entry.last_used + idle)
            running.update(expires_at=expires, size_vram=0, context_length=entry.served.backend.n_ctx)
            models.append(running)
        return json_response(request, {"models": models})


def install(root, registry):
    """Route `root`'s model endpoints (a tree of build_root) through `registry`, and list its models
    at /v1/models, /api/tags and /api/ps."""
    api = root.api if hasattr(root, "api") else None
    for base in (root, root.children[b"v1"]):
        for path in MODEL_PATHS:
            parent = base
            for segment in path[:-1]:
                parent = parent.children[segment]
            original = parent.children[path[-1]]
            kind = AnthropicModelRoute if path == (b"messages",) else ModelRoute
            parent.putChild(path[-1], kind(api, registry, original))
        base.putChild(b"models", AllModels(api, registry))
    ollama = root.children[b"api"]
    for name in OLLAMA_MODEL_PATHS:
        ollama.putChild(name, OllamaModelRoute(api, registry, ollama.children[name]))
    ollama.putChild(b"tags", OllamaTags(api, registry))
    ollama.putChild(b"ps", OllamaPs(api, registry))
    return root
