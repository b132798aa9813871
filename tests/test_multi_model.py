"""Several models in one real `twistd krafla --models FILE` (api/models.py, cli/registry.py).

Two chat models (SmolLM2-135M and Qwen2.5-Coder-0.5B, q4_0) and an embedding model (the tiny BERT of
tests/data/embedders), plus one whose file is damaged. Each model's replies must be the bytes a
one-model server gives for the same request, whatever the other models do at the same time; an
idle model is unloaded and loaded again on demand; a memory budget that fits one chat model but
not both is never passed (the server's peak resident memory, VmHWM); the damaged model's requests get
its load error while the others keep serving, and once its file is fixed it loads and serves (or, on the
registry's clock, after the retry wait); an unknown model is a 404 in each API's shape.
"""

import concurrent.futures
import re
import shutil

import httpx
import numpy as np
import pytest

from krafla_twisted.cli import registry
from krafla_twisted.convert.bert import convert_bert
from krafla_twisted.convert.gguf import convert_gguf
from tests.support.real_models import real_model
from tests.test_convert import write_gguf
from tests.support.server import ServerProcess

from pathlib import Path

DATA = Path(__file__).parent / "data" / "embedders"
COMMON = ["-t", "1", "--ctx", "512", "--max-tokens", "12"]
CHATS = {"smollm": "smollm2-135m", "coder": "qwen2.5-coder-0.5b"}
QUESTIONS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
             "Name three colours."]
SENTENCES = ["The cat sits on the mat.", "A dog runs in the park."]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    out = {name: real_model(known) for name, known in CHATS.items()}
    mlb, mlt = convert_bert(DATA / "tiny-bert", folder / "tiny-bert.mlb", folder / "tiny-bert.mlt", "f32",
                            progress=False)
    broken = folder / "broken.mlb"
    broken.write_bytes(b"KRAFLAMB" + bytes(range(256)) * 64)   # the magic, then no valid header
    shutil.copy(out["smollm"].mlt, folder / "broken.mlt")
    write_gguf(folder / "tiny-llama.gguf")   # a tiny random llama, converted by the server on its first load
    return {"smollm": (out["smollm"].mlb, out["smollm"].mlt), "coder": (out["coder"].mlb, out["coder"].mlt),
            "embed": (mlb, mlt), "broken": (broken, folder / "broken.mlt"), "folder": folder,
            "gguf": (folder / "tiny-llama.gguf", None)}


def models_file(files, path, names, parallel=2):
    lines = []
    for name in names:
        mlb, mlt = files[name]
        lines += ["[[models]]", f'name = "{name}"', f'file = "{mlb}"']
        if mlt is not None:
            lines.append(f'tokenizer = "{mlt}"')
        if name == "embed":
            lines.append("embeddings = true")
        elif name == "smollm":
            lines += [f"parallel = {parallel}", 'aliases = ["small"]']
        lines.append("")
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def server(files):
    path = models_file(files, files["folder"] / "models.toml", ["smollm", "coder", "embed", "broken", "gguf"])
    # its own cache: the .gguf is converted on its first load, into $KRAFLA_HOME/converted
    process = ServerProcess(["--models", str(path), "--idle-unload", "2", "--metrics", *COMMON],
                            env={"KRAFLA_HOME": str(files["folder"] / "home")}).start()
    process.baseline = memory_status(process, "VmRSS")   # nothing loaded yet
    yield process
    process.stop()


def memory_status(process, key):
    """A byte count of the server's /proc/PID/status: VmRSS (resident now) or VmHWM (the most it has
    been resident at any moment: the kernel's own high-water mark, so nothing between two reads is
    missed)."""
    with open(f"/proc/{process.process.pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


def chat(process, model, question, stream=False):
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 12, "stream": stream}
    response = httpx.post(process.url("/chat/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.text if stream else response.json()["choices"][0]["message"]["content"]


def embed(process, model="embed"):
    response = httpx.post(process.url("/embeddings"), json={"model": model, "input": SENTENCES}, timeout=120)
    assert response.status_code == 200, response.text
    return [d["embedding"] for d in response.json()["data"]]


def states(process):
    reply = httpx.get(process.url("/models"), timeout=30).json()
    return {m["id"]: m["state"] for m in reply["data"]}


def wait_until_unloaded(process, model, timeout=60):
    """Until the server logs that `model` was unloaded after its last load (at once if it was never
    loaded); the line is logged once the model is unloaded, so /v1/models says so too."""
    loads = [i for i, line in enumerate(process.lines) if f"loading model {model} from" in line]
    if loads:
        process.wait_for(lambda line: f"unloaded model {model} (" in line, timeout=timeout, start=loads[-1])
    assert states(process)[model] == "unloaded"


@pytest.fixture(scope="module")
def reference(files):
    """What one-model servers answer: the chat replies of each chat model, the embedding model's vectors."""
    out = {}
    for name in CHATS:
        mlb, mlt = files[name]
        extra = ["--parallel", "2"] if name == "smollm" else []
        process = ServerProcess([str(mlb), "-z", str(mlt), *COMMON, *extra]).start()
        try:
            out[name] = [chat(process, "anything", q) for q in QUESTIONS]
        finally:
            process.stop()
    mlb, mlt = files["embed"]
    process = ServerProcess(["--embeddings", str(mlb), "-z", str(mlt), "-t", "1"]).start()
    try:
        out["embed"] = embed(process, "anything")
    finally:
        process.stop()
    return out


def test_concurrent_clients_get_the_one_model_replies(server, reference):
    """Clients on three models at once: each reply is byte for byte the one-model server's."""
    jobs = [("smollm", i) for i in range(3)] + [("coder", i) for i in range(3)] + [("embed", 0), ("small", 1)]

    def run(job):
        model, index = job
        if model == "embed":
            return embed(server)
        return chat(server, model, QUESTIONS[index])

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (model, index), got in zip(jobs, results):
        if model == "embed":
            assert got == reference["embed"]
        else:
            assert got == reference["smollm" if model == "small" else model][index], (model, index)
    assert sum("loading model coder" in line for line in server.lines) >= 1


def test_two_requests_for_an_unloaded_model_load_it_once(server, reference):
    """Two requests at once for an unloaded model: one load (one log line), both replies as the one-model server's."""
    wait_until_unloaded(server, "coder")
    start = len(server.lines)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda q: chat(server, "coder", q), QUESTIONS[:2]))
    assert replies == reference["coder"][:2]
    assert sum("loading model coder" in line for line in server.lines[start:]) == 1


def test_idle_model_is_unloaded_and_loaded_again(server, reference):
    """--idle-unload 2: an idle model goes (seen in /v1/models) and its next request loads it again, same vectors."""
    assert embed(server) == reference["embed"]
    wait_until_unloaded(server, "embed")
    server.wait_for(lambda line: "unloaded model embed (idle for 2 s)" in line)
    assert embed(server) == reference["embed"]
    assert states(server)["embed"] == "loaded"


def test_a_damaged_file_fails_its_own_model_only(server, reference):
    """A damaged file: 503 model_load_failed with the loader's message (OpenAI's and Ollama's shapes), state
    failed with its error, and the other models keep answering."""
    response = httpx.post(server.url("/chat/completions"), timeout=60,
                          json={"model": "broken", "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "model_load_failed" and "broken" in error["message"]
    listed = {m["id"]: m for m in httpx.get(server.url("/models")).json()["data"]}
    assert listed["broken"]["state"] == "failed" and listed["broken"]["error"]
    # Ollama's shape for the same failure, and the other models still answer
    response = httpx.post(server.root_url("/api/chat"), json={"model": "broken", "stream": False,
                                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 503 and "could not be loaded" in response.json()["error"]
    assert chat(server, "smollm", QUESTIONS[0]) == reference["smollm"][0]


def test_a_fixed_file_is_loaded_again(files, reference, tmp_path):
    """A model whose file is damaged: its requests get 503 model_load_failed with the loader's message and
    when it is tried again, with no second load while the file stays as it is; once the file is fixed, the
    next request loads it and gets the one-model server's vectors."""
    good = files["embed"][0].read_bytes()
    mlb = tmp_path / "flaky.mlb"
    mlb.write_bytes(b"KRAFLAMB" + bytes(range(256)) * 64)   # the magic, then no valid header
    shutil.copy(files["embed"][1], tmp_path / "flaky.mlt")
    path = tmp_path / "models.toml"
    path.write_text(f'[[models]]\nname = "flaky"\nfile = "{mlb}"\nembeddings = true\n')
    process = ServerProcess(["--models", str(path), "-t", "1"]).start()
    try:
        for attempt in range(2):
            response = httpx.post(process.url("/embeddings"), json={"model": "flaky", "input": SENTENCES}, timeout=60)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "model_load_failed" and "The model 'flaky' could not be loaded: " in error["message"]
            assert "loaded again once its file changes" in error["message"]
        process.wait_for(lambda line: "cannot load the model flaky" in line)
        assert sum("loading model flaky from" in line for line in process.lines) == 1
        mlb.write_bytes(good)
        assert embed(process, "flaky") == reference["embed"]
        process.wait_for(lambda line: "trying the model flaky again (its file changed)" in line)
        assert states(process)["flaky"] == "loaded"
    finally:
        process.stop()


def test_a_gguf_is_converted_on_its_first_load(server, files, tmp_path):
    """The .gguf entry is converted once into $KRAFLA_HOME/converted, the same bytes `krafla convert`
    writes, and served from there."""
    response = httpx.post(server.url("/completions"), json={"model": "gguf", "prompt": "a b", "max_tokens": 4},
                          timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    (converted,) = (files["folder"] / "home" / "converted").glob("*/tiny-llama.mlb")
    mlb, mlt = convert_gguf(files["gguf"][0], tmp_path / "tiny-llama.mlb", tmp_path / "tiny-llama.mlt", progress=False)
    assert converted.read_bytes() == mlb.read_bytes()
    assert converted.with_suffix(".mlt").read_bytes() == mlt.read_bytes()


def test_unknown_model_is_a_404_in_each_apis_shape(server):
    """An unknown model: 404 model_not_found (OpenAI), not_found_error (Anthropic), {"error"} (Ollama)."""
    response = httpx.post(server.url("/chat/completions"), json={"model": "nope", "messages": []})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url("/models/nope")).json()["error"]["code"] == "model_not_found"
    response = httpx.post(server.url("/messages"), json={"model": "nope", "max_tokens": 4, "messages": []})
    assert response.status_code == 404
    assert response.json() == {"type": "error", "error": {"type": "not_found_error",
                                                          "message": "The model 'nope' does not exist"}}
    response = httpx.post(server.root_url("/api/chat"), json={"model": "nope", "messages": []})
    assert response.status_code == 404 and response.json() == {"error": "The model 'nope' does not exist"}
    response = httpx.post(server.root_url("/api/embed"), json={"model": "nope", "input": "x"})
    assert response.status_code == 404 and response.json() == {"error": "The model 'nope' does not exist"}


def test_listings_and_metrics_name_every_model(server):
    """/api/tags lists every model, /api/ps the loaded ones, /v1/models/ALIAS its model; /metrics has model labels."""
    chat(server, "smollm", QUESTIONS[0])
    tags = httpx.get(server.root_url("/api/tags")).json()["models"]
    assert [m["name"] for m in tags] == ["smollm", "coder", "embed", "broken", "gguf"]
    details = {m["name"]: m["details"] for m in tags}
    # loaded or not, a model's details are its file's: the tiny BERT was converted as f32
    assert (details["embed"]["family"], details["embed"]["quantization_level"]) == ("bert", "F32")
    assert details["smollm"]["family"] == "llama" and details["smollm"]["quantization_level"] == "Q4_0"
    assert details["broken"]["family"] == "" and details["broken"]["quantization_level"] == ""
    assert "smollm" in [m["name"] for m in httpx.get(server.root_url("/api/ps")).json()["models"]]
    assert httpx.get(server.url("/models/small")).json()["id"] == "smollm"
    text = httpx.get(server.root_url("/metrics")).text
    assert re.search(r'krafla_requests_total\{endpoint="chat/completions",status="200",model="smollm"\} \d+', text)
    assert re.search(r'krafla_completion_tokens_total\{model="coder"\} \d+', text)


def test_file_header_is_what_the_file_holds(files):
    """registry.file_header, the details of a model not loaded: the file's arch and file_type and the
    elements of all its tensors; nothing for a damaged header or a .gguf (read when converted)."""
    from krafla_twisted.engine import formats

    container = formats.read(files["embed"][0])
    header = registry.file_header(str(files["embed"][0]))
    n_elements = sum(int(np.prod(t.shape)) for t in container.tensors.values())
    assert header == {"arch": "bert", "n_params": n_elements, "file_type": "F32"}
    assert registry.file_header(str(files["broken"][0])) == {}
    assert registry.file_header(str(files["gguf"][0])) == {}


def test_memory_budget_is_never_passed(files, server, reference):
    """A budget that holds SmolLM2 or Qwen but not both: loading Qwen unloads the idle SmolLM2, and the
    server's peak resident memory (VmHWM) never goes past the budget."""
    base = {}
    names = ["smollm", "coder"]
    path = models_file(files, files["folder"] / "budget.toml", names)
    estimates = {n: registry.read_models_file(str(path), {"parallel": 1, "ctx": 512})[i].estimate
                 for i, n in enumerate(names)}
    base["rss"] = server.baseline
    budget = base["rss"] + estimates["coder"] + 24 * 2**20 + estimates["smollm"] // 4
    process = ServerProcess(["--models", str(path), "--max-memory", str(budget), *COMMON]).start()
    peak = [0]
    try:
        assert chat(process, "smollm", QUESTIONS[0]) == reference["smollm"][0]
        assert chat(process, "coder", QUESTIONS[1]) == reference["coder"][1]
        assert states(process)["smollm"] == "unloaded"
        process.wait_for(lambda line: "unloaded model smollm (to make room within --max-memory)" in line)
        assert chat(process, "smollm", QUESTIONS[2]) == reference["smollm"][2]
        peak[0] = memory_status(process, "VmHWM")
    finally:
        process.stop()
    print(f"memory budget {budget / 2**20:.0f} MiB (estimates: coder {estimates['coder'] / 2**20:.0f} MiB, smollm "
          f"{estimates['smollm'] / 2**20:.0f} MiB), resident at most {peak[0] / 2**20:.0f} MiB")
    assert 0 < peak[0] <= budget, f"resident {peak[0] / 2**20:.0f} MiB past the budget {budget / 2**20:.0f} MiB"


def test_models_dir_names_each_model_by_its_file(files, tmp_path):
    """--models-dir: each .mlb named by its file stem, an encoder served as an embedding model; an empty folder refused."""
    for suffix in (".mlb", ".mlt"):
        shutil.copy(files["embed"][0].with_suffix(suffix), tmp_path / f"encoder{suffix}")
    specs = registry.read_models_dir(str(tmp_path), {"parallel": 1})
    assert [(s.name, s.embeddings) for s in specs] == [("encoder", True)]
    (tmp_path / "empty").mkdir()
    with pytest.raises(registry.ModelsFileError, match="no .mlb"):
        registry.read_models_dir(str(tmp_path / "empty"), {})


def test_pooling_rank_makes_an_embeddings_entry(tmp_path):
    """`pooling = "rank"` (a decoder reranker) is an embeddings entry without saying so; another pooling
    still needs `embeddings = true`, and an unknown one is refused."""
    (tmp_path / "judge.mlb").write_bytes(b"")
    (tmp_path / "judge.mlt").write_bytes(b"")
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "judge"\nfile = "judge.mlb"\npooling = "rank"\n')
    (spec,) = registry.read_models_file(str(path), {"parallel": 1})
    assert spec.embeddings and spec.settings == {"pooling": "rank"}
    for extra, words in (('pooling = "mean"', "goes with `embeddings = true`"),
                         ('pooling = "max"\nembeddings = true', "mean, cls, last or rank")):
        path.write_text(f'[[models]]\nname = "judge"\nfile = "judge.mlb"\n{extra}\n')
        with pytest.raises(registry.ModelsFileError, match=re.escape(words)):
            registry.read_models_file(str(path), {"parallel": 1})


def test_the_documented_models_file_reads(tmp_path):
    """docs/server.md's models file: every key valid, each entry as the prose says; as YAML the same."""
    text = (Path(__file__).parent.parent / "docs" / "server.md").read_text()
    section = text[text.index("## Several models"):]
    example = re.search(r"```toml\n(.*?)```", section, re.DOTALL).group(1)
    for name in re.findall(r'^(?:file|tokenizer) = "([^"]+)"', example, re.MULTILINE):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "SmolLM2-135M-Instruct-Q4_0.mlt").write_bytes(b"")
    (tmp_path / "models.toml").write_text(example)
    specs = registry.read_models_file(str(tmp_path / "models.toml"), {"parallel": 4})
    assert [(s.name, s.aliases, s.embeddings) for s in specs] == [
        ("smollm", ("small", "gpt-4o-mini"), False), ("coder", (), False), ("minilm", (), True)]
    assert specs[0].tokenizer == str(tmp_path / "SmolLM2-135M-Instruct-Q4_0.mlt")
    assert specs[1].settings == {"chat": "qwen", "kv": "q8_0", "threads": 2} and specs[1].tokenizer is None
    import tomllib
    import yaml

    (tmp_path / "models.yaml").write_text(yaml.safe_dump(tomllib.loads(example)))
    assert registry.read_models_file(str(tmp_path / "models.yaml"), {"parallel": 4}) == specs
    (tmp_path / "bad.toml").write_text(example.replace("ctx = 2048", "context = 2048"))
    with pytest.raises(registry.ModelsFileError, match="unknown key 'context'"):
        registry.read_models_file(str(tmp_path / "bad.toml"), {"parallel": 4})


# ---------------------------------------------------------------------------------------------
# The registry's rules, on a clock: loads that cost known bytes, a loading "thread" that runs at once.

class _Reactor:
    """A task.Clock whose callFromThread runs at once (the fake pool below runs its work in place)."""

    def __init__(self):
        from twisted.internet.task import Clock

        self.clock = Clock()
        self.seconds, self.callLater = self.clock.seconds, self.clock.callLater

    def callFromThread(self, function, *args, **kwargs):
        function(*args, **kwargs)


class _InPlacePool:
    def start(self):
        pass

    def stop(self):
        pass

    def callInThreadWithCallback(self, on_result, function, *args, **kwargs):
        from twisted.python.failure import Failure

        try:
            result = function(*args, **kwargs)
        except Exception:
            on_result(False, Failure())
        else:
            on_result(True, result)


class _Memory:
    """The fake process's resident bytes: what the loaded fakes hold."""

    def __init__(self):
        self.held = {}

    def __call__(self):
        return sum(self.held.values())


def _registry(sizes, budget, idle=None, broken=(), folder=None):
    from krafla_twisted.api import models

    memory, loads = _Memory(), []

    class Runtime:
        def __init__(self, spec):
            self.spec = spec
            memory.held[spec.name] = spec.estimate

        def close(self):
            del memory.held[self.spec.name]

    class Served:
        def __init__(self, spec, runtime, backend):
            self.runtime = runtime

        def close(self):
            self.runtime.close()

    class Backend:
        def banner(self):
            return "fake"

    def load(spec):
        loads.append(spec.name)
        if spec.name in broken:
            raise ValueError(f"{spec.name}: not a model file")
        return Runtime(spec), Backend()

    specs = [registry.ModelSpec(name=name, path=str(folder / f"{name}.mlb") if folder else f"/{name}.mlb",
                                tokenizer=None, estimate=size)
             for name, size in sizes.items()]
    reactor = _Reactor()
    reg = models.Registry(specs, load, Served, reactor, idle_unload=idle, max_memory=budget, resident=memory,
                          pool=_InPlacePool())
    reg.start()
    return reg, reactor, memory, loads


def _state(reg):
    return {e.name: e.state for e in reg.entries}


def _use(reg, name):
    """Acquire the model and release it at once; the outcome of the acquisition."""
    entry = reg.lookup(name)
    outcome = []
    reg.acquire(entry).addBoth(outcome.append)
    reg.release(entry)
    return outcome[0]


def test_registry_unloads_the_least_recently_used_idle_model():
    """Past the budget, the idle model used longest ago is unloaded first."""
    reg, reactor, memory, _ = _registry({"a": 100, "b": 100, "c": 100}, budget=250)
    _use(reg, "a")
    reactor.clock.advance(1)
    _use(reg, "b")
    reactor.clock.advance(1)
    _use(reg, "a")   # a is now the more recently used
    reactor.clock.advance(1)
    _use(reg, "c")
    assert _state(reg) == {"a": "loaded", "b": "unloaded", "c": "loaded"} and memory() <= 250


def test_registry_never_unloads_a_busy_model_and_loads_once():
    """A load that does not fit waits while the other model has a request running; two waiters, one load."""
    reg, reactor, memory, loads = _registry({"a": 100, "b": 100}, budget=150)
    a, b = reg.lookup("a"), reg.lookup("b")
    reg.acquire(a)                         # a request runs on a
    first, second = reg.acquire(b), reg.acquire(b)
    assert _state(reg) == {"a": "loaded", "b": "loading"} and not first.called
    reg.release(a)                         # a's request is over: a goes, b loads, once for both requests
    assert first.called and second.called and loads == ["a", "b"]
    assert _state(reg) == {"a": "unloaded", "b": "loaded"} and memory() <= 150


def test_registry_unloads_idle_models_and_fails_what_cannot_load():
    """Idle unload on time; a model larger than the budget, or whose load raises, fails once and stays failed."""
    from krafla_twisted.api.models import ModelLoadFailed

    reg, reactor, memory, loads = _registry({"a": 100, "huge": 500, "bad": 10}, budget=300, idle=60, broken={"bad"})
    _use(reg, "a")
    reactor.clock.advance(59)
    assert _state(reg)["a"] == "loaded"
    reactor.clock.advance(1)
    assert _state(reg)["a"] == "unloaded" and memory() == 0
    failure = _use(reg, "huge")
    assert failure.check(ModelLoadFailed) and "past --max-memory" in failure.value.message
    failure = _use(reg, "bad")
    assert failure.check(ModelLoadFailed) and "not a model file" in failure.value.message
    assert _use(reg, "bad").check(ModelLoadFailed) and loads.count("bad") == 1   # failed stays failed (within the retry wait)
    assert _state(reg) == {"a": "unloaded", "huge": "failed", "bad": "failed"}


def test_registry_tries_a_failed_model_again_after_the_backoff():
    """A failed model's requests fail at once, with no new load, until LOAD_RETRY_SECONDS have passed on
    the registry's clock since the failure; then a request loads it again (a second failure starts the
    wait over), and once its load works it serves."""
    from twisted.python.failure import Failure

    from krafla_twisted.api.models import LOAD_RETRY_SECONDS, ModelLoadFailed

    broken = {"bad"}
    reg, reactor, _, loads = _registry({"bad": 10}, budget=None, broken=broken)
    assert "on a request 30 s after the failure" in _use(reg, "bad").value.message
    reactor.clock.advance(LOAD_RETRY_SECONDS - 1)
    assert _use(reg, "bad").check(ModelLoadFailed) and loads == ["bad"]
    reactor.clock.advance(1)
    assert _use(reg, "bad").check(ModelLoadFailed) and loads == ["bad", "bad"]
    reactor.clock.advance(LOAD_RETRY_SECONDS - 1)
    assert _use(reg, "bad").check(ModelLoadFailed) and loads == ["bad", "bad"]
    broken.clear()
    reactor.clock.advance(1)
    assert not isinstance(_use(reg, "bad"), Failure) and _state(reg) == {"bad": "loaded"} and len(loads) == 3


def test_registry_tries_a_failed_model_again_when_its_file_changes(tmp_path):
    """No wait for a changed file: a request after the file's size or modification time changed loads
    the model again at once; a file left as it is does not."""
    from twisted.python.failure import Failure

    from krafla_twisted.api.models import ModelLoadFailed

    (tmp_path / "bad.mlb").write_bytes(b"damaged")
    broken = {"bad"}
    reg, reactor, _, loads = _registry({"bad": 10}, budget=None, broken=broken, folder=tmp_path)
    assert _use(reg, "bad").check(ModelLoadFailed) and _use(reg, "bad").check(ModelLoadFailed)
    assert loads == ["bad"]
    (tmp_path / "bad.mlb").write_bytes(b"still damaged")   # changed, and its load fails again
    assert _use(reg, "bad").check(ModelLoadFailed) and loads == ["bad", "bad"]
    broken.clear()
    (tmp_path / "bad.mlb").write_bytes(b"a model")
    assert not isinstance(_use(reg, "bad"), Failure) and _state(reg) == {"bad": "loaded"} and len(loads) == 3
