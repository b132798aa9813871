"""`twistd krafla`: the options and the service of the OpenAI-compatible server.

    twistd -n krafla Qwen2.5-0.5B-Instruct-Q4_0.mlb -z tokenizer.mlt --chat qwen -t 4
    twistd --pidfile krafla.pid --logfile krafla.log krafla MODEL.mlb -z TOK.mlt --port 8080

Without a model argument the default model is used, pulled and converted on first use.
"""

import getopt
import ipaddress
import os
import re
import sys
from urllib.parse import urlsplit

from twisted.application import service
from twisted.logger import Logger
from twisted.python import usage

from krafla_twisted.api.resources import DEFAULT_MAX_QUEUE
from krafla_twisted.cli import options
from krafla_twisted.engine import clib
from krafla_twisted.generation.scheduler import DEFAULT_PARALLEL

log = Logger(namespace="krafla")

DEFAULT_PORT = 8080
DEFAULT_HOST = "127.0.0.1"
MAX_PARALLEL = 256
SHUTDOWN_GRACE_SECONDS = 5  # at SIGTERM, how long replies ended with an error get to reach their clients


# -z, --chat, --system and every engine and sampling option: one table shared with `krafla run`.
_ENGINE_PARAMETERS, _ENGINE_FLAGS = options.twistd_rows()


class Options(usage.Options):
    synopsis = "[options] [MODEL.mlb]"
    longdesc = (
        "Serve one model with the endpoints of the OpenAI API: /v1/chat/completions, /v1/completions, "
        "/v1/models and /health; also /tokenize, /detokenize and, with --metrics, /metrics. "
        "Without MODEL, the default model is pulled and served; with --models or --models-dir, several "
        "models, each loaded on its first request."
    )
    optParameters = [
        ["host", None, DEFAULT_HOST, "IP address to listen on (0.0.0.0 for every IPv4 interface), or localhost."],
        ["port", None, DEFAULT_PORT, "TCP port; 0 picks a free port, printed at start.", int],
        ["api-key", None, None, "Require 'Authorization: Bearer KEY' (default: $KRAFLA_API_KEY if set)."],
        ["alias", None, None, "Model id in responses and /v1/models (default: the file name without .mlb)."],
        ["cors", None, None, "Let web pages from these origins call the server from a browser: "
         "scheme://host[:port] as the browser sends it, e.g. http://localhost:3000 (comma-separated; * for any)."],
        ["allow-host", None, None, "Without an API key, also answer requests addressed to these DNS names "
         "(comma-separated; * for any); by default only localhost and IP addresses, against DNS rebinding."],
        ["max-queue", None, DEFAULT_MAX_QUEUE, "Requests that may wait beyond the ones being answered (one per "
         "--parallel slot); more get 503 with Retry-After.", int],
        ["pooling", None, None, "With --embeddings: pool the tokens' hidden states by mean, cls or last "
         "(default: what the model file says, as its sentence-transformers config did); rank serves a decoder "
         "reranker (Qwen3-Reranker style: the probability of 'yes') at /v1/rerank, --embeddings implied."],
        ["models", None, None, "Serve several models, each loaded on its first request: a TOML (or YAML) file "
         "listing them (name, file, tokenizer, chat, ctx, parallel, kv, threads, aliases, embeddings; docs/server.md)."],
        ["models-dir", None, None, "Serve every .mlb in this folder (each with its .mlt beside it), named by its "
         "file name without .mlb, each loaded on its first request."],
        ["idle-unload", None, 300.0, "With --models/--models-dir: unload a model idle for this many seconds "
         "(0: never).", float],
        ["max-memory", None, None, "With --models/--models-dir: resident memory the server may use, as bytes, "
         "NK/NM/NG or N% of RAM (default 75%); the least recently used idle models are unloaded to stay within it."],
        ["parallel", None, DEFAULT_PARALLEL, "Replies generated side by side, batched in the same forward steps; each "
         "is a slot with its own KV cache of --ctx tokens (memory: N x the KV cache). 1 answers one at a time.", int],
    ] + _ENGINE_PARAMETERS
    optFlags = list(_ENGINE_FLAGS) + [
        ["metrics", None, "Serve Prometheus metrics at /metrics (behind the API key, if any)."],
        ["embeddings", None, "Serve an embedding model (a BERT-family encoder .mlb with its WordPiece .mlt, or a "
         "decoder embedder) at /v1/embeddings, /v1/rerank (a cross-encoder; a decoder reranker with --pooling rank) "
         "and Ollama's /api/embed, instead of "
         "text generation; without MODEL, all-MiniLM-L6-v2 (pulled on first use)."],
        ["log-queue", None, "Log 'queue: N pending' whenever a request joins or leaves the engine's queue."],
    ]

    def __init__(self):
        super().__init__()
        self["listen"] = []

    def opt_listen(self, description):
        """Listen on a Twisted endpoint instead of --host/--port, e.g. tcp:8080:interface=0.0.0.0,
        unix:/run/krafla.sock, ssl:8443:privateKey=key.pem:certKey=cert.pem (repeatable)."""
        from krafla_twisted.api.listen import check_description

        try:
            check_description(description)
        except ValueError as e:
            raise usage.UsageError(str(e)) from None
        self["listen"].append(description)

    def parseOptions(self, options=None):
        """Accept the model path before or after the options, as `krafla run` does (getopt stops at it)."""
        if options is None:
            options = sys.argv[1:]
        try:
            pairs, positional = getopt.gnu_getopt(options, self.shortOpt, self.longOpt)
        except getopt.error as e:
            raise usage.UsageError(str(e)) from None
        ordered = []
        for name, value in pairs:
            ordered += [name, value] if self._takes_value(name) else [name]
        super().parseOptions(ordered + ["--"] + positional)

    def _takes_value(self, name):
        if name.startswith("--"):
            return name[2:] + "=" in self.longOpt
        letter = self.shortOpt.index(name[1])
        return self.shortOpt[letter + 1:letter + 2] == ":"

    def parseArgs(self, model=None):
        self["model"] = model

    def postOptions(self):
        self["host"] = parse_host(self["host"])
        if not 0 <= self["port"] <= 65535:
            raise usage.UsageError(f"--port must be 0 to 65535, not {self['port']}")
        if self["api-key"] is None:
            self["api-key"] = os.environ.get("KRAFLA_API_KEY") or None
        if self["api-key"] is not None and not self["api-key"].strip():
            raise usage.UsageError("--api-key must not be empty")
        self["cors"] = parse_cors(self["cors"]) if self["cors"] is not None else ()
        if self["max-queue"] < 0:
            raise usage.UsageError(f"--max-queue must be at least 0, not {self['max-queue']}")
        if not 1 <= self["parallel"] <= MAX_PARALLEL:
            raise usage.UsageError(f"--parallel must be 1 to {MAX_PARALLEL}, not {self['parallel']}")
        if self["pooling"] == "rank" and self["models"] is None and self["models-dir"] is None:
            if self["model"] is None:
                raise usage.UsageError("--pooling rank needs the reranker's model file: "
                                       "twistd krafla --pooling rank MODEL.mlb -z MODEL.mlt")
            self["embeddings"] = True  # a reranker is served by the embeddings runtime
        if self["pooling"] is not None and not self["embeddings"]:
            raise usage.UsageError("--pooling goes with --embeddings")
        if self["pooling"] not in (None, "mean", "cls", "last", "rank"):
            raise usage.UsageError(f"--pooling must be mean, cls, last or rank, not {self['pooling']!r}")
        clear_unusable_pidfile(getattr(self, "parent", None))
        try:
            options.validate(options.values(self))
        except ValueError as e:
            raise usage.UsageError(str(e)) from None
        self._check_models()
        if self["specs"] is not None:
            return  # each model's files were checked with its entry
        model = self["model"]
        if model is not None and not os.path.isfile(model):
            raise usage.UsageError(f"model file not found: {model}")
        tokenizer = self.get("tokenizer")
        if model is not None and tokenizer is None:
            raise usage.UsageError("-z TOKENIZER.mlt is required with a model file")
        if tokenizer is not None and not os.path.isfile(tokenizer):
            raise usage.UsageError(f"tokenizer file not found: {tokenizer}")


    def _check_models(self):
        """--models / --models-dir: read the list now, so a bad file stops the start with its error."""
        from krafla_twisted.cli import registry

        self["specs"] = None
        if self["idle-unload"] < 0:
            raise usage.UsageError(f"--idle-unload must be at least 0, not {self['idle-unload']}")
        several = [name for name in ("models", "models-dir") if self[name] is not None]
        if not several:
            for name in ("max-memory",):
                if self[name] is not None:
                    raise usage.UsageError(f"--{name} goes with --models or --models-dir")
            return
        if len(several) == 2:
            raise usage.UsageError("give --models or --models-dir, not both")
        for clash in ("model", "embeddings", "alias", "draft"):
            if self.get(clash):
                what = "a model file" if clash == "model" else f"--{clash}"
                raise usage.UsageError(f"--{several[0]} names the models: {what} goes in its entries, not on the "
                                       "command line")
        self["max-memory"] = parse_memory(self["max-memory"])
        try:
            if self["models"] is not None:
                self["specs"] = registry.read_models_file(self["models"], self)
            else:
                self["specs"] = registry.read_models_dir(self["models-dir"], self)
        except registry.ModelsFileError as e:
            raise usage.UsageError(str(e)) from None


def total_memory():
    """MemTotal of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def parse_memory(text):
    """--max-memory in bytes: N, NK, NM, NG (powers of 1024) or N% of RAM; None (no budget) where RAM is unknown."""
    text = "75%" if text is None else text.strip()
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if not 0 < share <= 100:
                raise ValueError
            total = total_memory()
            return int(total * share / 100) if total else None
        scale = units.get(text[-1:].lower(), 1)
        number = float(text[:-1] if scale != 1 else text)
        if number <= 0:
            raise ValueError
        return int(number * scale)
    except ValueError:
        raise usage.UsageError(f"--max-memory takes bytes, NK, NM, NG or N% of RAM, not {text!r}") from None


def clear_unusable_pidfile(twistd_options):
    """twistd exits at start when its pidfile holds no number (say, left empty by a crash or a full
    disk): such a file names no process, so remove it, as twistd removes one naming a dead process."""
    pidfile = twistd_options.get("pidfile") if twistd_options is not None else None
    if not pidfile or not os.path.isfile(pidfile):
        return
    try:
        with open(pidfile, "rb") as f:
            pid = int(f.read(64))
        if 0 < pid < 2**31:
            return
    except (OSError, ValueError):
        pass
    try:
        os.remove(pidfile)
    except OSError as e:
        raise usage.UsageError(f"the pidfile {pidfile} holds no process id and cannot be removed: {e}") from None
    print(f"krafla: removed the pidfile {pidfile}, which held no process id", file=sys.stderr)


def parse_cors(text):
    """The origins of --cors (comma-separated): "*", or each exactly as a browser sends it in its
    Origin header (scheme://host[:port], lower case, no path, no default port), because a request's
    Origin is compared with them byte for byte: anything else would never match, so it is refused."""
    origins = []
    for value in (part.strip() for part in text.split(",")):
        if value == "*":
            origins.append(value)
            continue
        expected = _origin_form(value)
        if expected != value:
            hint = f"; did you mean {expected}?" if expected else ""
            raise usage.UsageError(f"--cors takes origins such as http://localhost:3000 (scheme://host[:port], as a "
                                   f"browser sends them in its Origin header) or *, not {value!r}{hint}")
        origins.append(value)
    return tuple(origins)


def _origin_form(value):
    """`value` serialized as a browser's Origin header, or None if it names no origin."""
    if not re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", value):
        return None
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.username is not None or parts.password is not None or parts.query or \
            parts.fragment or parts.path not in ("", "/"):
        return None
    scheme, host = parts.scheme.lower(), parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is not None and {"http": 80, "https": 443}.get(scheme) != port:
        host = f"{host}:{port}"
    return f"{scheme}://{host}"


def parse_host(text):
    """An IP address or "localhost" (127.0.0.1); other host names are refused (no DNS at start-up)."""
    if text == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise usage.UsageError(f"--host takes an IP address or localhost, not {text!r}") from None


def listen_url(host, port):
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


class StartupError(Exception):
    """The server cannot start (the model does not load, the port is taken)."""


class KraflaService(service.Service):
    """Loads the model and listens when started; stops listening, cancels work and frees it when stopped.

    Loading happens in startService, not in makeService, because twistd forks after makeService
    when it daemonizes and the engine's own threads would not survive the fork.
    """

    name = "krafla"

    def __init__(self, config, reactor):
        self.config = config
        self.reactor = reactor
        self.runtime = None
        self.worker = None
        self.ports = []
        self.registry = None  # --models: the models' registry (api/models.py)
        self.api = None  # hardening: the API and Site, for a graceful stop
        self.site = None

    def startService(self):
        from krafla_twisted.api import metrics
        from krafla_twisted.api.backend import Backend
        from krafla_twisted.api.resources import API
        from krafla_twisted.api.routes import build_root
        from krafla_twisted.api.site import APISite
        from krafla_twisted.api.worker import EngineWorker
        from krafla_twisted.cli import startup
        from krafla_twisted.engine import pack

        super().startService()
        if self.config.get("specs"):  # --models / --models-dir: nothing is loaded before a request
            access = self._access()
            root, counters = self._start_models(self.config, access)
            self.site = APISite(root, self.reactor, metrics=counters)
            self._listen(self.config, self.site)
            return
        config = self.config
        if config.get("model") is None and not config.get("embeddings"):
            from krafla_twisted.cli import models

            log.info("no model given: using {name} (pulled and converted on first use)", name=models.DEFAULT_MODEL)
        try:
            if config.get("embeddings"):
                runtime, backend = load_embeddings(config)
            else:
                runtime = startup.load_runtime(config, parallel=config["parallel"])
                backend = Backend.serving(runtime, alias=config.get("alias"))
        except (clib.KraflaError, OSError, ValueError, RuntimeError) as e:  # also OptionError, ChatError, PullError
            self._fail(f"cannot load the model: {e}")
        self.runtime = runtime
        self.worker = EngineWorker(self.reactor, backend, log_queue=bool(config.get("log-queue")))
        self.worker.start()
        log.info("{banner}", banner=backend.banner())
        pack_warning = pack.warning(runtime.model)  # a --pack-cache that could not be written says why
        if pack_warning:
            log.warn("{warning}", warning=pack_warning)
        access = self._access()
        api = API(backend, self.worker, access, self.reactor, max_queue=config["max-queue"])
        self.api = api
        counters = metrics.Metrics(pending=lambda: self.worker.pending() if self.worker else 0,
                                   scheduler=backend.scheduler) if config.get("metrics") else None
        site = APISite(build_root(api, counters), self.reactor, metrics=counters)
        self.site = site
        self._listen(config, site)

    def _access(self):
        from krafla_twisted.api.access import Access

        config = self.config
        hosts = tuple(name.strip() for name in config["allow-host"].split(",") if name.strip()) if config["allow-host"] else ()
        return Access(config["api-key"], config["cors"], allowed_hosts=hosts)

    def _start_models(self, config, access):
        """--models / --models-dir: the registry (nothing loaded yet) and the front tree routing to it."""
        from krafla_twisted.api import metrics, models
        from krafla_twisted.api.resources import API
        from krafla_twisted.api.responses import ResponseStore
        from krafla_twisted.api.routes import build_root

        specs = config["specs"]
        stored_responses = ResponseStore()  # shared: a response's id is found whichever model wrote it

        def serve(spec, runtime, backend):
            return models.Served(runtime, backend, access, self.reactor, max_queue=config["max-queue"],
                                 stored_responses=stored_responses, log_queue=bool(config.get("log-queue")))

        idle = config["idle-unload"] or None
        self.registry = models.Registry(specs, lambda spec: load_model(spec, config), serve, self.reactor,
                                        idle_unload=idle, max_memory=config["max-memory"])
        self.registry.start()
        front = API(None, None, access, self.reactor, max_queue=config["max-queue"])
        self.api = front
        counters = metrics.Metrics(engines=self.registry.engines) if config.get("metrics") else None
        root = models.install(build_root(front, counters, stored_responses=stored_responses), self.registry)
        budget = config["max-memory"]
        log.info("# krafla: {n} models ({names}), loaded on first request; idle unload {idle}, memory budget {budget}",
                 n=len(specs), names=", ".join(spec.name for spec in specs),
                 idle=f"{idle:g} s" if idle else "never",
                 budget=f"{budget / 2**20:.0f} MiB" if budget else "none")
        return root, counters

    def _listen(self, config, site):
        from twisted.internet import endpoints

        from krafla_twisted.api import listen

        host = config["host"]
        if config.get("listen"):
            wanted = [(listen.make_endpoint(self.reactor, text), text) for text in config["listen"]]
        elif ":" in host:
            wanted = [(endpoints.TCP6ServerEndpoint(self.reactor, config["port"], interface=host), f"{host}:{config['port']}")]
        else:
            wanted = [(endpoints.TCP4ServerEndpoint(self.reactor, config["port"], interface=host), f"{host}:{config['port']}")]
        for endpoint, where in wanted:
            failures = []
            d = endpoint.listen(site)
            d.addCallbacks(lambda port, endpoint=endpoint: self._listening(port, endpoint), failures.append)
            if failures:
                # TCP, TLS and unix sockets listen synchronously: say why and exit non-zero instead of serving nothing.
                self.stopService()
                self._fail(f"cannot listen on {where}: {failures[0].getErrorMessage()}")

    def _fail(self, message):
        twistd = getattr(self.config, "parent", None)
        if twistd is not None and twistd.get("nodaemon"):
            raise SystemExit(f"krafla: {message}")
        # Daemonized, twistd passes an Exception (not SystemExit) to the parent process waiting for
        # the start, which prints it and exits 1.
        raise StartupError(message)

    def _listening(self, port, endpoint):
        from krafla_twisted.api.listen import listening_line, reaches_beyond_this_machine

        self.ports.append(port)
        log.info("{line}", line=listening_line(endpoint, port))
        if reaches_beyond_this_machine(port) and not self.config["api-key"]:
            log.warn("listening beyond this machine without an API key; set --api-key or KRAFLA_API_KEY")

    def stopService(self):
        super().stopService()
        for port in self.ports:
            port.stopListening()
        self.ports = []
        if self.api is not None:
            self.api.shutdown()  # replies in flight end now with an error event or a 503
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        if self.registry is not None:
            self.registry.stop()  # every loaded model's replies end, its thread stops, its memory is freed
            self.registry = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        if self.site is not None:
            # Let the ended replies reach their clients before the reactor stops.
            site, self.site = self.site, None
            return site.close_connections(SHUTDOWN_GRACE_SECONDS)


def load_model(spec, config):
    """One model of --models (cli/registry.ModelSpec) as (runtime, backend); runs in the loading thread."""
    from krafla_twisted.api.backend import Backend
    from krafla_twisted.cli import startup

    settings = spec.config(config)
    if spec.embeddings:
        return load_embeddings(settings)
    runtime = startup.load_runtime(settings, parallel=settings["parallel"])
    return runtime, Backend.serving(runtime, alias=spec.name)


def load_embeddings(config):
    """--embeddings: the encoder's EmbeddingRuntime and the API backend serving it."""
    from krafla_twisted.api.backend import file_stem
    from krafla_twisted.api.embeddings import EmbeddingBackend
    from krafla_twisted.generation.embeddings import EmbeddingRuntime

    values = options.validate(options.values(config))
    threads = values["threads"] or options.default_threads()
    model, tokenizer = config["model"], config["tokenizer"]
    if model is None:  # the known embedding model, pulled and converted on first use
        from krafla_twisted.cli import models

        pulled = models.pull_embedder(models.DEFAULT_EMBEDDER, progress=False)
        model, tokenizer = str(pulled.mlb), str(pulled.mlt)
    runtime = EmbeddingRuntime.load(model, tokenizer, threads=threads, pooling=config["pooling"])
    return runtime, EmbeddingBackend(runtime, model_id=config.get("alias") or file_stem(model))


def makeService(config, reactor=None):
    if reactor is None:
        if not config.get("listen"):
            without_tls()
        from twisted.internet import reactor
    return KraflaService(config, reactor)


def without_tls():
    """Serving plain HTTP on --host/--port, keep pyOpenSSL out of the process: Twisted's reactor and
    endpoints import it when they can, and run without TLS when they cannot. That saves about 12 MiB
    of resident memory (pyOpenSSL, cryptography and their libraries), much beside a small model.
    Only twistd's own call of makeService comes here, before the reactor is imported; a process that
    loaded pyOpenSSL already keeps it, and any --listen (ssl: may be among them) keeps it importable."""
    if "OpenSSL" not in sys.modules:
        sys.modules["OpenSSL"] = None  # `import OpenSSL` raises ImportError from here on
