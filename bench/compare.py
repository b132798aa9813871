"""krafla against llama.cpp on the same q4_0 weights, measured side by side, in one run.

    .venv/bin/python bench/compare.py                      # everything: builds, GGUFs, benches, server
    .venv/bin/python bench/compare.py --rounds 5 --models smollm2-135m --no-server
    .venv/bin/python bench/compare.py --isa avx2           # only the AVX2 pair
    .venv/bin/python bench/compare.py --published --llama-bin native=/work/llama/build-native/bin --no-server
    .venv/bin/python bench/compare.py --moe 8 --llama-bin native=DIR   # a Qwen3-30B-A3B-shaped MoE, Q4_K_M and MXFP4
    .venv/bin/python bench/compare.py --published --models qwen2.5-coder-1.5b --roofline -t 1 --no-server
    .venv/bin/python bench/compare.py --dense qwen2.5-7b --roofline -t 1   # a Qwen2.5-7B-shaped Q4_K_M

--published compares the files as users get them instead (issue 13): krafla's default conversion
(`krafla pull NAME`: the published file's types where the engine computes on them) with the library
a default install loads (the best ISA this CPU runs), against llama.cpp's default build (`native`)
on the original GGUF, with issue 13's target of 1.2x for pp and tg. `--published --isa avx2` is the
same on a CPU without AVX-512 (most desktop and laptop Intel CPUs): krafla's AVX2 library against
llama.cpp's AVX2 build, which is what its default build compiles there.

What it does, caching every product under vendor/ (gitignored; nothing there is committed):

1. krafla: `make BUILD=vendor/krafla vendor/krafla/avx2/libkrafla.so` (and the avx512 library when
   this CPU has AVX-512 VNNI).
2. llama.cpp: the `llama-cpp-python` source distribution from the package index
   (`pip download --no-deps --no-binary :all:`), its vendored llama.cpp built twice with cmake
   (targets llama-bench and llama-quantize): `avx2`, the peer of krafla's AVX2 build
   (GGML_NATIVE=OFF GGML_AVX2=ON GGML_FMA=ON GGML_F16C=ON), and `native` (GGML_NATIVE=ON: AVX-512
   here), the peer of krafla's ISA=avx512 build; on a CPU with AMX, `native` without AMX, whose
   matmuls crash this llama.cpp (LLAMA_NO_AMX below).
3. The GGUFs: each known model's pulled GGUF (krafla_twisted.cli.models.fetch_source) requantized by
   llama-quantize --allow-requantize to Q4_0, with the token embedding and output head given the
   block types krafla's q4_0 .mlb holds (q8_0/q4_0), so both programs read the same kind of blocks.
4. `krafla bench MODEL.mlb -t T -p P -n N --json -r 1` and `llama-bench -m MODEL.gguf -t T -p P -n N
   -o json -r 1`, alternated model by model for --rounds rounds (the one that goes first swaps each
   round). The machine may be busy, so a lone time says little: the ratio krafla/llama.cpp is
   taken within each round, and the table gives the median ratio with its range over the rounds.
5. --roofline: this machine's read bandwidth at -t threads (bench/stream_read.c, built into vendor/
   on every run; the faster of its two loops), measured in every round just before and just after
   each model's pair of runs, the better reading counting; its buffer on huge pages, as krafla's
   packed weights) and each model's bytes read per generated token (every weight but the token
   embedding, of which one row is read; a tied embedding is the output head and counts; of a
   mixture's experts, the ones a token uses, so --moe takes --roofline too): tg / (bandwidth /
   bytes) is the share of the roofline each program reaches, issue 29's target being 90% for
   krafla on a 1B+ model.
6. End to end through the server (--no-server skips it): `twistd -n krafla MODEL.mlb --metrics`,
   then streamed chat requests (each with a fresh prompt, so nothing comes from the KV cache):
   time to first token, reply tokens/s as the client sees them, and the server's own overhead per
   request = client wall time - the engine's prompt + generation seconds (from /metrics).
"""

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")
# llama.cpp's flavour that is the peer of each krafla ISA
LLAMA_PEER = {"avx2": "avx2", "avx512": "native"}
LLAMA_CMAKE = {
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"],
    "native": ["-DGGML_NATIVE=ON"],
}
LLAMA_TARGETS = ("llama-bench", "llama-quantize")
# On a CPU with AMX (Intel Xeon since Sapphire Rapids), GGML_NATIVE=ON also compiles llama.cpp's AMX
# matmuls, which in llama-cpp-python 0.3.36's llama.cpp fault at their first `ldtilecfg` (a
# general protection fault in ggml_backend_amx_mul_mat on every prompt; llama.cpp issue 20824, open
# PR 26954), while AMX itself works on such a machine. The peer is then the default build with AMX
# left out: the same -march=native, AVX-512 and VNNI included.
LLAMA_NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]


def leaves_out_amx(flavor):
    """Whether the llama.cpp build of `flavor` is compiled without AMX: `native` on a CPU with it."""
    from krafla_twisted.engine import clib

    return flavor == "native" and "amx_tile" in clib.cpu_flags()


def llama_cmake(flavor):
    """cmake's options for a llama.cpp build of `flavor`."""
    options = list(LLAMA_CMAKE[flavor])
    if leaves_out_amx(flavor):
        flags = " ".join(LLAMA_NO_AMX)
        options += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    return options
# issue 6's targets: (test kind, model) -> minimum ratio krafla / llama.cpp
TARGETS = {"pp": 1.2, "tg": 1.2, ("tg", "qwen2.5-coder-0.5b"): 1.0}
TARGETS_AVX512 = 1.0
TARGET_PUBLISHED = 1.2  # issue 13: the published files, krafla's default install vs llama.cpp native
TARGET_ROOFLINE = 0.9   # issue 29: generation at 90% of the read roofline


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def run(cmd, **kwargs):
    log("+", " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def markdown_table(head, lines):
    """Print a Markdown table: the head, then one row per line (lists of strings), columns padded."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for line in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")


# --- builds


def build_krafla(vendor, isa, jobs):
    """libkrafla.so for `isa` (only that one), built by the project's Makefile into vendor/krafla."""
    library = vendor / "krafla" / isa / "libkrafla.so"
    run(["make", "-C", ROOT, f"BUILD={vendor / 'krafla'}", f"-j{jobs}", library], stdout=subprocess.DEVNULL)
    if not library.is_file():
        raise SystemExit(f"make did not produce {library}")
    return library


def llama_source(vendor, requirement):
    """The llama.cpp tree inside the llama-cpp-python sdist, downloaded and unpacked once."""
    sdists = vendor / "llama.cpp" / "sdist"
    found = sorted(sdists.glob("llama_cpp_python-*.tar.gz")) if sdists.is_dir() else []
    if not found:
        sdists.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", sdists, requirement])
        found = sorted(sdists.glob("llama_cpp_python-*.tar.gz"))
        if not found:
            raise SystemExit(f"pip download left no llama_cpp_python sdist in {sdists}")
    archive = found[-1]
    unpacked = vendor / "llama.cpp" / "src" / archive.name[: -len(".tar.gz")]
    tree = unpacked / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        unpacked.parent.mkdir(parents=True, exist_ok=True)
        log(f"unpacking {archive.name}")
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked.parent, filter="data")
        if not (tree / "CMakeLists.txt").is_file():
            raise SystemExit(f"{archive.name} has no vendor/llama.cpp/CMakeLists.txt")
    return tree


def build_llama(vendor, tree, flavor, jobs, prebuilt=None):
    """bin/ of a llama.cpp build (`avx2` or `native`) with llama-bench and llama-quantize (or the
    `prebuilt` bin/ given for that flavour with --llama-bin)."""
    if prebuilt and flavor in prebuilt:
        return prebuilt[flavor]
    no_amx = "-no-amx" if leaves_out_amx(flavor) else ""
    build = vendor / "llama.cpp" / f"build-{flavor}{no_amx}-{tree.parent.parent.name}"
    binaries = build / "bin"
    if all((binaries / t).is_file() for t in LLAMA_TARGETS):
        return binaries
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", tree, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release", *llama_cmake(flavor),
         "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"], stdout=subprocess.DEVNULL)
    run(["cmake", "--build", build, "--config", "Release", f"-j{jobs}", "--target", *LLAMA_TARGETS],
        stdout=subprocess.DEVNULL)
    return binaries


# --- weights


def krafla_types(mlb):
    """(token embedding type, output head type) of a krafla .mlb, e.g. ('q8_0', 'q8_0')."""
    from krafla_twisted.engine.container import ContainerFile

    types = {name: type_name for name, type_name, _shape, _bytes in ContainerFile(str(mlb)).tensors}
    embedding = types["token_embd.weight"]
    return embedding, types.get("output.weight", embedding)  # tied: the embedding is the head


def llama_gguf(vendor, name, quantize):
    """The Q4_0 GGUF llama.cpp runs for the known model `name`, made once from the pulled GGUF."""
    from krafla_twisted.cli import models

    pulled = models.pull(name, type_name="q4_0")
    source = models.fetch_source(name)
    embedding, output = krafla_types(pulled.mlb)
    out = vendor / "gguf" / f"{name}-Q4_0-embd_{embedding}-out_{output}.gguf"
    requantized(quantize, source, out, "--output-tensor-type", output, "--token-embedding-type", embedding, threads=2)
    return pulled, out


def requantized(quantize, source, out, *options, threads=None):
    """`out`: `llama-quantize --allow-requantize OPTIONS SOURCE OUT Q4_0 [THREADS]`, made once."""
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        run([quantize, "--allow-requantize", *options, source, partial, "Q4_0", *([threads] if threads else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        partial.rename(out)
    return out


# --- the read roofline


def stream_reader(vendor):
    """vendor/roofline/stream_read, built from bench/stream_read.c on every run (a second of gcc):
    a binary left there by another command, say one without -march=native (SSE2 loads, about a
    tenth slower), would otherwise stand in for the roofline as long as it is newer than the source."""
    binary = vendor / "roofline" / "stream_read"
    binary.parent.mkdir(parents=True, exist_ok=True)
    run([os.environ.get("CC", "gcc"), "-O2", "-march=native", "-pthread", ROOT / "bench" / "stream_read.c", "-o", binary])
    return binary


def read_bandwidth(reader, threads):
    """Bytes per second `threads` threads stream from memory (the best of stream_read's passes)."""
    out = subprocess.run([str(reader), str(threads)], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["gb_per_s"] * 1e9


def bytes_per_token(mlb):
    """The weight bytes one generated token reads: every tensor but the token embedding, of which
    one row is read, unless the embedding is also the output head (tied), which reads it whole; of
    a mixture's stacked expert tensors (`*_exps`), the n_experts_used experts of a token."""
    from krafla_twisted.engine.container import ContainerFile

    container = ContainerFile(str(mlb))
    used = container.metadata.get("n_experts_used", 0) / container.metadata.get("n_experts", 1)
    sizes = {name: n_bytes * used if "_exps." in name else n_bytes
             for name, _type, _shape, n_bytes in container.tensors}
    total = sum(sizes.values())
    return total - sizes["token_embd.weight"] if "output.weight" in sizes else total


# --- benches


def krafla_bench(library, isa, mlb, threads, prompt, generate, extra=()):
    """{'pp': tokens/s, 'tg': tokens/s} from one `krafla bench -r 1` (after its warm-up run)."""
    env = dict(os.environ, KRAFLA_LIB=str(library), KRAFLA_ISA=isa)
    cmd = [sys.executable, "-m", "krafla_twisted.cli.main", "bench", mlb, "-t", threads, "-p", prompt, "-n", generate,
           "-r", "1", "--json", *extra]
    out = subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, env=env).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {row["test"][:2]: row["median"] for row in rows}


def llama_bench(binaries, gguf, threads, prompt, generate, extra=()):
    """{'pp': tokens/s, 'tg': tokens/s} from one `llama-bench -r 1` (after its warm-up run)."""
    cmd = [binaries / "llama-bench", "-m", gguf, "-t", threads, "-p", prompt, "-n", generate, "-r", "1", "-o", "json",
           *extra]
    out = subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True).stdout
    result = {}
    for row in json.loads(out):
        result["pp" if row["n_prompt"] and not row["n_gen"] else "tg"] = row["avg_ts"]
    return result


def random_model(gguf, write):
    """(krafla's .mlb as a pull's namespace, the GGUF) of a random bench model: `write(path)` writes
    the GGUF once (through a .partial file, so an interrupted run writes it again), and `krafla
    convert` makes the .mlb keeping its blocks, so both programs read the same weights."""
    import types

    mlb = gguf.with_suffix(".mlb")
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing {gguf}")
        write(gguf.with_suffix(".partial"))
        gguf.with_suffix(".partial").rename(gguf)
    if not mlb.is_file() or mlb.stat().st_mtime < gguf.stat().st_mtime:
        run([sys.executable, "-m", "krafla_twisted.cli.main", "convert", gguf, "-o", mlb, "-q"])
    return types.SimpleNamespace(mlb=mlb), gguf


def moe_models(vendor, layers, variants):
    """--moe: {name: (krafla's .mlb, the GGUF)} of bench/moe_model.py's random qwen3moe with
    Qwen3-30B-A3B's per-layer shapes and `layers` layers, one per variant (q4_K_M, mxfp4), the
    tokenizer from the default model's GGUF (random_model)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import moe_model
    from krafla_twisted.cli import models

    tokenizer = models.fetch_source(models.DEFAULT_MODEL)
    found = {}
    for variant in variants:
        name = f"qwen3moe-{layers}-layers-{variant}"
        found[name] = random_model(vendor / "moe" / f"{name}.gguf",
                                   lambda path, v=variant: moe_model.write_gguf(path, layers, v, tokenizer))
    return found


def dense_models(vendor, shapes):
    """--dense: {name: (krafla's .mlb, the GGUF)} of bench/dense_model.py's random dense models of
    the given shapes (qwen2.5-7b), each tensor of the type it has in a published Q4_K_M GGUF of the
    same layer count, whose tokenizer it takes too (random_model)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import dense_model
    from krafla_twisted.cli import models

    found = {}
    for shape in shapes:
        if shape not in dense_model.SHAPES:
            raise SystemExit(f"--dense {shape}: expected one of {', '.join(dense_model.SHAPES)}")
        like = models.fetch_source(dense_model.SHAPES[shape]["like"])
        name = f"{shape}-random-q4_K_M"
        found[name] = random_model(vendor / "dense" / f"{name}.gguf",
                                   lambda path, s=shape, t=like: dense_model.write_gguf(path, t, s))
    return found


def published_models(names):
    """--published: {name: (krafla's default pull, the original GGUF)}."""
    from krafla_twisted.cli import models

    return {name: (models.pull(name), models.fetch_source(name)) for name in names}


def compare(pairs, models, args):
    """Rounds of alternated runs; returns rows of the ratio table."""
    samples = {}  # (isa, model, kind) -> list of (krafla, llama)
    roofline = {}  # (isa, model) -> list of (krafla tg, llama tg, roofline tokens/s), each of one round
    peers = {isa: peer for isa, _library, _binaries, peer in pairs}
    reader = stream_reader(args.vendor.resolve()) if args.roofline else None
    token_bytes = {name: bytes_per_token(pulled.mlb) for name, (pulled, _gguf) in models.items()} if reader else {}
    for round_index in range(args.rounds):
        for isa, library, binaries, _peer in pairs:
            for name, (pulled, gguf) in models.items():
                bandwidth = read_bandwidth(reader, args.threads) if reader else None
                runs = [("krafla", lambda: krafla_bench(library, isa, pulled.mlb, args.threads, args.prompt,
                                                        args.generate, args.krafla_args)),
                        ("llama", lambda: llama_bench(binaries, gguf, args.threads, args.prompt, args.generate,
                                                      args.llama_args))]
                if round_index % 2:
                    runs.reverse()
                got = {who: fn() for who, fn in runs}
                for kind in ("pp", "tg"):
                    if kind in got["krafla"] and kind in got["llama"]:
                        samples.setdefault((isa, name, kind), []).append((got["krafla"][kind], got["llama"][kind]))
                if bandwidth and "tg" in got["krafla"] and "tg" in got["llama"]:
                    # the memory of a shared machine gives more at some moments than at others: the
                    # roofline is the better of the readings before and after the round's runs
                    bandwidth = max(bandwidth, read_bandwidth(reader, args.threads))
                    roof = bandwidth / token_bytes[name]
                    roofline.setdefault((isa, name), []).append((got["krafla"]["tg"], got["llama"]["tg"], roof))
                    log(f"  read roofline {bandwidth / 1e9:.1f} GB/s: {roof:.1f} tokens/s")
                log(f"round {round_index + 1}/{args.rounds} {isa} {name}: krafla {fmt(got['krafla'])}, "
                    f"llama.cpp {fmt(got['llama'])}")
    args.roofline_samples = roofline
    args.token_bytes = token_bytes
    rows = []
    for (isa, name, kind), pairs_ in samples.items():
        ratios = [k / l for k, l in pairs_]
        test = f"{kind}{args.prompt if kind == 'pp' else args.generate}"
        if args.published:
            target = TARGET_PUBLISHED
        else:
            target = TARGETS_AVX512 if isa == "avx512" else TARGETS.get((kind, name), TARGETS[kind])
        rows.append({
            "isa": isa, "peer": peers[isa], "model": name, "test": test,
            "krafla": statistics.median(k for k, _ in pairs_), "llama": statistics.median(l for _, l in pairs_),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "rounds": len(ratios), "target": target,
        })
    return rows


def fmt(result):
    return " ".join(f"{k} {v:.1f}" for k, v in sorted(result.items()))


def print_ratio_table(rows, args):
    head = ["krafla", "llama.cpp", "model", "test", "krafla t/s", "llama.cpp t/s", "ratio", "range", "target", ""]
    lines = [[r["isa"], r["peer"], r["model"], r["test"], f"{r['krafla']:.1f}", f"{r['llama']:.1f}",
              f"{r['ratio']:.2f}x", f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}", f">= {r['target']:.1f}x",
              "met" if r["ratio"] >= r["target"] else "NOT met"] for r in rows]
    markdown_table(head, lines)
    print(f"(-t {args.threads}; t/s medians and krafla/llama.cpp ratio median over {args.rounds} alternated rounds, "
          f"each run after its own warm-up; load average at the end: {os.getloadavg()[0]:.1f})")


def print_roofline_table(samples, token_bytes, args):
    """Generation against the read roofline: per model the bytes a token reads, the medians over the
    rounds of the roofline, of each program's tg, and of the share of the roofline each reached
    (the share taken within each round)."""
    head = ["krafla", "model", "MiB per token", "roofline t/s", "krafla tg t/s", "krafla share", "llama.cpp tg t/s",
            "llama.cpp share", "target", ""]
    lines = []
    for (isa, name), rows in samples.items():
        share = statistics.median(k / roof for k, _, roof in rows)
        lines.append([isa, name, f"{token_bytes[name] / 2 ** 20:.0f}",
                      f"{statistics.median(r for _, _, r in rows):.1f}", f"{statistics.median(k for k, _, _ in rows):.1f}",
                      f"{share:.0%}", f"{statistics.median(l for _, l, _ in rows):.1f}",
                      f"{statistics.median(l / roof for _, l, roof in rows):.0%}", f">= {TARGET_ROOFLINE:.0%}",
                      "met" if share >= TARGET_ROOFLINE else "NOT met"])
    markdown_table(head, lines)
    print(f"(-t {args.threads} -n {args.generate}; the roofline is bench/stream_read.c's read bandwidth at -t threads "
          f"divided by the bytes a token reads, the better of its readings before and after each round's runs)")


# --- end to end through the server


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def engine_seconds(port):
    """prompt_seconds_total + generation_seconds_total from /metrics."""
    _status, text = http_get(port, "/metrics")
    total = 0.0
    for name in ("krafla_prompt_seconds_total", "krafla_generation_seconds_total"):
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        if not match:
            raise SystemExit(f"/metrics has no {name}")
        total += float(match.group(1))
    return total


def chat_body(content, max_tokens):
    """The JSON body of a streamed greedy chat completion of one user message, usage in its last event."""
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "stream": True,
                       "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "temperature": 0}).encode()


def stream_event(line):
    """(content deltas, usage or None) of one line of a streamed chat completion's server-sent events."""
    line = line.strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        return 0, None
    event = json.loads(line[6:])
    contents = sum(1 for choice in event.get("choices", []) if choice.get("delta", {}).get("content"))
    return contents, event.get("usage") or None


def wait_healthy(server, port, timeout=120):
    """Poll GET /health until it answers 200; SystemExit if the process `server` ends or `timeout`
    seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if http_get(port, "/health")[0] == 200:
                return
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start (exit status {server.poll()})")
        time.sleep(0.2)


def stop_server(server):
    """SIGTERM, then SIGKILL if the process is still there after 30 s."""
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def streamed_chat(port, content, max_tokens):
    """(time to first content, seconds from first to last content, content chunks, usage, total seconds)."""
    body = chat_body(content, max_tokens)
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"chat request: HTTP {response.status}: {response.read()[:500]!r}")
    first = last = None
    chunks, usage = 0, None
    for raw in response:
        contents, event_usage = stream_event(raw.decode())
        usage = event_usage or usage
        if contents:
            now = time.perf_counter()
            first = first or now
            last = now
            chunks += contents
    total = time.perf_counter() - start
    conn.close()
    if first is None:
        raise SystemExit("chat request: the stream had no content")
    return first - start, last - first, chunks, usage, total


def server_figures(library, isa, pulled, args):
    """Streamed chat requests against `twistd -n krafla`; medians of the figures."""
    port = free_port()
    env = dict(os.environ, KRAFLA_LIB=str(library), KRAFLA_ISA=isa)
    twistd = Path(sys.executable).parent / "twistd"
    cmd = [twistd, "-n", "--pidfile=", "--logfile=-", "krafla", pulled.mlb, "-z", pulled.mlt, "--chat", pulled.chat,
           "--port", port, "-t", args.threads, "--metrics", "-n", args.server_tokens, *args.krafla_args]
    log("+", " ".join(str(c) for c in cmd))
    server = subprocess.Popen([str(c) for c in cmd], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_healthy(server, port)
        streamed_chat(port, "Warm up.", 8)
        results = []
        for i in range(args.server_requests):
            before = engine_seconds(port)
            ttft, span, chunks, usage, total = streamed_chat(
                port, f"Request {i}: write a short story about a lighthouse keeper number {i * 7919}.",
                args.server_tokens)
            engine = engine_seconds(port) - before
            tokens = usage["completion_tokens"] if usage else chunks
            results.append({"ttft": ttft, "tg": (tokens - 1) / span if span > 0 and tokens > 1 else 0.0,
                            "overhead": total - engine, "prompt_tokens": usage["prompt_tokens"] if usage else 0,
                            "tokens": tokens, "total": total})
        return {key: statistics.median(r[key] for r in results) for key in results[0]}
    finally:
        stop_server(server)


def print_server_table(rows, args):
    print()
    print("| krafla | model | prompt tokens | time to first token | reply tokens/s (client) | server overhead/request |")
    print("| ------ | ----- | ------------: | ------------------: | ----------------------: | ----------------------: |")
    for isa, name, f in rows:
        print(f"| {isa} | {name} | {f['prompt_tokens']:.0f} | {f['ttft'] * 1000:.0f} ms | {f['tg']:.1f} | "
              f"{f['overhead'] * 1000:.1f} ms |")
    print(f"(median of {args.server_requests} streamed chat requests of {args.server_tokens} tokens each, -t "
          f"{args.threads}; overhead = client wall time - engine prompt + generation seconds from /metrics)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="known model names, comma-separated")
    parser.add_argument("--isa", default=None,
                        help="krafla builds to compare: avx2,avx512 (default: avx2, plus avx512 on a VNNI CPU)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("-p", "--prompt", type=int, default=512)
    parser.add_argument("-n", "--generate", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build jobs")
    parser.add_argument("--vendor", type=Path, default=ROOT / "vendor", help="build cache (default vendor/)")
    parser.add_argument("--llama-cpp-python", default="llama-cpp-python", help="pip requirement of the sdist")
    parser.add_argument("--krafla-arg", dest="krafla_args", action="append", default=[],
                        help="extra option for krafla bench and the server, e.g. --krafla-arg=--no-pack (repeatable)")
    parser.add_argument("--llama-arg", dest="llama_args", action="append", default=[],
                        help="extra option for llama-bench, e.g. --llama-arg=--repack --llama-arg=0 where the CPU "
                             "reports AMX but the system does not let a process use it (repeatable)")
    parser.add_argument("--llama-bin", action="append", default=[], metavar="FLAVOR=DIR",
                        help="use an existing llama.cpp bin/ for avx2 or native instead of building it (repeatable)")
    parser.add_argument("--published", action="store_true",
                        help="the published files: krafla's default pull and install against llama.cpp's default "
                             "build on the original GGUF (issue 13); with --isa avx2 as on a CPU without AVX-512: "
                             "krafla's AVX2 library against llama.cpp's AVX2 build")
    parser.add_argument("--moe", type=int, default=0, metavar="LAYERS",
                        help="compare on a random qwen3moe model with Qwen3-30B-A3B's per-layer shapes and LAYERS "
                             "layers (bench/moe_model.py), Q4_K_M and MXFP4 variants, instead of --models (issue 28)")
    parser.add_argument("--moe-types", default="q4_K_M,mxfp4", help="the --moe variants (q4_K_M, mxfp4, q8_0)")
    parser.add_argument("--dense", default="", metavar="SHAPES",
                        help="compare on random dense models of these shapes (qwen2.5-7b), the published Q4_K_M "
                             "file's tensor types (bench/dense_model.py), instead of --models (issue 29)")
    parser.add_argument("--roofline", action="store_true",
                        help="also measure the read bandwidth and give generation as a share of the roofline")
    parser.add_argument("--no-server", action="store_true", help="skip the end-to-end server figures")
    parser.add_argument("--server-requests", type=int, default=3)
    parser.add_argument("--server-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    from krafla_twisted.engine import clib

    random_weights = bool(args.moe or args.dense)
    if args.published or random_weights:
        args.published = True  # --moe, --dense: the default install against llama.cpp's default build
        args.no_server = args.no_server or random_weights  # random weights: nothing to chat with
        args.isa = args.isa or clib.cpu_isa()  # what a default install loads
    if args.isa:
        isas = args.isa.split(",")
    else:
        isas = ["avx2"] + (["avx512"] if clib.cpu_isa() == "avx512" else [])
    for isa in isas:
        if isa not in LLAMA_PEER:
            parser.error(f"--isa {isa}: expected avx2 or avx512")
    prebuilt = {}
    for item in args.llama_bin:
        flavor, _, folder = item.partition("=")
        if flavor not in LLAMA_CMAKE or not all((Path(folder) / t).is_file() for t in LLAMA_TARGETS):
            parser.error(f"--llama-bin {item}: expected avx2=DIR or native=DIR holding {' and '.join(LLAMA_TARGETS)}")
        prebuilt[flavor] = Path(folder).resolve()
    vendor = args.vendor.resolve()
    # --published --isa avx2 stands for a CPU without AVX-512, where llama.cpp's default (native) build is its AVX2 one
    peer = {isa: LLAMA_PEER[isa] for isa in isas}
    needed = set(peer.values()) | (set() if args.published else {"avx2"})
    tree = llama_source(vendor, args.llama_cpp_python) if needed - set(prebuilt) else None
    pairs = [(isa, build_krafla(vendor, isa, args.jobs),
              build_llama(vendor, tree, peer[isa], args.jobs, prebuilt), peer[isa]) for isa in isas]
    if args.moe:
        models = moe_models(vendor, args.moe, args.moe_types.split(","))
    elif args.dense:
        models = dense_models(vendor, args.dense.split(","))
    elif args.published:
        models = published_models(args.models.split(","))
    else:
        quantize = build_llama(vendor, tree, "avx2", args.jobs, prebuilt) / "llama-quantize"
        models = {name: llama_gguf(vendor, name, quantize) for name in args.models.split(",")}
    rows = compare(pairs, models, args)
    source = tree.parent.parent.name if tree else ", ".join(f"{k}: {v}" for k, v in prebuilt.items())
    weights = ("random qwen3moe weights, the same GGUF blocks" if args.moe else
               "random dense weights of the published Q4_K_M's types, the same GGUF blocks" if args.dense else
               "the published files (krafla's default conversion)" if args.published else "q4_0")
    print(f"krafla vs llama.cpp ({source}), {weights}, -t {args.threads} -p {args.prompt} "
          f"-n {args.generate}")
    print_ratio_table(rows, args)
    if args.roofline:
        print_roofline_table(args.roofline_samples, args.token_bytes, args)
    if not args.no_server:
        server_rows = []
        for isa, library, _binaries, _peer in pairs:
            for name, (pulled, _gguf) in models.items():
                server_rows.append((isa, name, server_figures(library, isa, pulled, args)))
        print_server_table(server_rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
