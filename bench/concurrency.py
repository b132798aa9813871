"""Many clients at once: krafla against llama-server, C concurrent streamed chats (issue 15).

    .venv/bin/python bench/concurrency.py --llama-bin /work/llama/build-native/bin --llama-arg=-nr
    .venv/bin/python bench/concurrency.py --llama-bin DIR --models smollm2-135m --clients 1,2 --max-tokens 8 \\
        --rounds 1 --krafla-arg=              # a krafla without --parallel: no extra server option

For each model, each number of clients C (--clients) and each of --rounds rounds, both servers
are started on the same weights, one after the other (which one goes first alternates by round):

- krafla: `twistd -n krafla MODEL.mlb -z MODEL.mlt --chat T --ctx CTX -t T --parallel C` (the last
  option comes from --krafla-arg, whose `{parallel}` is replaced by C; default `--parallel={parallel}`);
- llama-server: `llama-server -m MODEL.gguf -np C -c C*CTX -t T -cb` (continuous batching), with
  the --llama-arg options (`-nr` where the CPU reports AMX but the system forbids it).

The weights: with --weights q4_0 (default, as issue 15 measured) krafla's `--type q4_0` pull and
the published GGUF requantized to Q4_0 with the same embedding and output block types (as
bench/compare.py makes it); with --weights native krafla's default pull and the published GGUF
itself, whose blocks krafla's .mlb keeps.

Each server gets one warm-up request once /health answers 200, then C streamed chat completions
at once (treq, every prompt different, T=0, --max-tokens each). Per batch: aggregate generated
tokens/s (all reply tokens / the wall time from the first request sent to the last byte
received), time to first token (first content delta) p50 and p95 over the clients, and each
client's tokens/s after its first token (median over the clients); then the resident set of both
server processes (VmRSS of /proc/PID/status). The tables give medians over the rounds and the
ratio krafla / llama-server (taken within each round), with issue 15's targets: aggregate at 4
and more clients >= 1.5x, p95 time to first token <= llama-server's, resident set <= 1.1 x
(weights + slots x KV cache; the KV figure from krafla's banner when it states one, else computed
from the model's shape and the banner's context and KV type), and one client on `--parallel N`
within 3% of `--parallel 1` (N the largest C; --no-single skips it). For that comparison both
krafla servers run side by side and take turns: --single-pairs requests each per round, the same
prompt to both within a pair, the ratio taken per pair and the median over all pairs (a single
half-second reply per server start, as before, swung by ±20% with the host).
"""

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy

from krafla_twisted.generation import generate  # KV_VALUE_BYTES: the bytes of one cached value per KV type

from compare import (chat_body, free_port, llama_gguf, log, markdown_table, stop_server, stream_event,
                     streamed_chat, wait_healthy)  # bench/compare.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
TARGET_AGGREGATE = 1.5  # krafla / llama-server, aggregate tokens/s ...
TARGET_AGGREGATE_FROM = 4  # ... from this many clients on
TARGET_MEMORY = 1.10  # resident set / (weights + slots x KV cache)
TARGET_SINGLE = 0.97  # one client: --parallel N / --parallel 1
SUBJECTS = ("a lighthouse keeper", "a clockmaker", "a beekeeper", "a glacier guide", "a ferry captain",
            "a librarian", "a volcano", "a chess player", "a baker", "a night-train conductor", "a cartographer",
            "a tide pool", "a violin maker", "a snowplough driver", "an astronomer", "a fisherwoman")


# --- pure figures (tests/test_bench_concurrency.py)


def prompts(count, round_index, model):
    """`count` different chat prompts for one batch, none shared with another round or model."""
    return [f"Round {round_index}, client {i} of {count} ({model}): write a short story about "
            f"{SUBJECTS[i % len(SUBJECTS)]} number {(round_index * 131 + i) * 7919}." for i in range(count)]


def batch_figures(replies):
    """The figures of one batch from its replies (dicts of perf_counter times `sent`, `first` content,
    `end` = last byte, and `tokens`): aggregate tokens/s, p50/p95 time to first token in seconds,
    median per-client tokens/s after the first token, total tokens, wall seconds."""
    start = min(r["sent"] for r in replies)
    wall = max(r["end"] for r in replies) - start
    tokens = sum(r["tokens"] for r in replies)
    to_first = [r["first"] - r["sent"] for r in replies]
    per_client = [(r["tokens"] - 1) / (r["end"] - r["first"]) if r["tokens"] > 1 and r["end"] > r["first"] else 0.0
                  for r in replies]
    return {"aggregate": tokens / wall, "ttft_p50": float(numpy.percentile(to_first, 50)),
            "ttft_p95": float(numpy.percentile(to_first, 95)), "client_tps": statistics.median(per_client),
            "tokens": tokens, "wall": wall}


def verdict(value, target, at_most=False):
    """'met' or 'NOT met' for a ratio against its target (a minimum, or a maximum with at_most); '' without one."""
    if target is None or value is None:
        return ""
    return "met" if (value <= target if at_most else value >= target) else "NOT met"


def kv_cache_bytes(metadata, n_ctx, kv):
    """Keys and values of one slot: 2 x layers x positions x KV heads x head size, in the KV type's bytes."""
    return 2 * metadata["n_layers"] * n_ctx * metadata["n_kv_heads"] * metadata["head_dim"] * generate.KV_VALUE_BYTES[kv]


def kv_from_banner(banner, metadata):
    """(slots, KV cache bytes of all slots, 'banner' or 'computed') from krafla's start banner: its
    `parallel P (KV cache P x S MiB)` when it says so, else one slot of its `context N` and `kv T`
    computed from the model's shape."""
    stated = re.search(r"KV cache (\d+) x ([0-9.]+) MiB", banner)
    if stated:
        return int(stated.group(1)), int(stated.group(1)) * float(stated.group(2)) * 2**20, "banner"
    context, kv = re.search(r"context (\d+) of", banner), re.search(r"\bkv (\w+)", banner)
    if not context or not kv:
        raise ValueError(f"krafla's banner names no context or kv type: {banner!r}")
    return 1, kv_cache_bytes(metadata, int(context.group(1)), kv.group(1)), "computed"


def paired(samples, key):
    """(median krafla, median llama-server, median of the per-round ratios) of figure `key`."""
    krafla = [k[key] for k, _ in samples]
    llama = [l[key] for _, l in samples]
    ratios = [k[key] / l[key] if l[key] else float("inf") for k, l in samples]
    return statistics.median(krafla), statistics.median(llama), statistics.median(ratios)


def concurrency_rows(samples):
    """Rows of the main table from {(model, clients): [(krafla figures, llama-server figures) per round]}."""
    rows = []
    for (model, clients), pairs in samples.items():
        krafla, llama, ratio = paired(pairs, "aggregate")
        target = TARGET_AGGREGATE if clients >= TARGET_AGGREGATE_FROM else None
        p95_krafla, p95_llama, _ = paired(pairs, "ttft_p95")
        rows.append({
            "table": "concurrency", "model": model, "clients": clients, "rounds": len(pairs),
            "aggregate_krafla": krafla, "aggregate_llama": llama, "aggregate_ratio": ratio,
            "aggregate_target": target, "aggregate_met": verdict(ratio, target),
            "ttft_p50_krafla": paired(pairs, "ttft_p50")[0], "ttft_p50_llama": paired(pairs, "ttft_p50")[1],
            "ttft_p95_krafla": p95_krafla, "ttft_p95_llama": p95_llama,
            "ttft_p95_met": verdict(p95_krafla, p95_llama, at_most=True),
            "client_tps_krafla": paired(pairs, "client_tps")[0], "client_tps_llama": paired(pairs, "client_tps")[1],
            "tokens_krafla": paired(pairs, "tokens")[0], "tokens_llama": paired(pairs, "tokens")[1],
        })
    return rows


def memory_rows(samples):
    """Rows of the memory table from the same samples (krafla's figures carry rss, weights, kv, slots)."""
    rows = []
    for (model, clients), pairs in samples.items():
        krafla = pairs[-1][0]
        expected = krafla["weights"] + krafla["kv"]
        rss = statistics.median(k["rss"] for k, _ in pairs)
        rows.append({
            "table": "memory", "model": model, "clients": clients, "slots": krafla["slots"],
            "rss_krafla": rss, "rss_llama": statistics.median(l["rss"] for _, l in pairs),
            "weights": krafla["weights"], "kv": krafla["kv"], "kv_from": krafla["kv_from"],
            "rss_ratio": rss / expected, "rss_met": verdict(rss / expected, TARGET_MEMORY, at_most=True),
        })
    return rows


def single_rows(samples, parallel):
    """Rows of the one-client table from {model: [(--parallel 1 figures, --parallel N figures) per pair]}:
    medians, and the quartiles of the per-pair ratios."""
    rows = []
    for model, pairs in samples.items():
        many, one, ratio = paired([(many, one) for one, many in pairs], "aggregate")
        ratios = [n["aggregate"] / o["aggregate"] for o, n in pairs]
        low, high = numpy.percentile(ratios, [25, 75]) if len(ratios) > 1 else (ratio, ratio)
        rows.append({"table": "single", "model": model, "parallel": parallel, "aggregate_parallel_1": one,
                     "aggregate_parallel_n": many, "ratio": ratio, "ratio_q1": float(low), "ratio_q3": float(high),
                     "pairs": len(pairs), "met": verdict(ratio, TARGET_SINGLE)})
    return rows


def mib(n):
    return f"{n / 2**20:.0f} MiB"


def concurrency_lines(rows):
    head = ["model", "clients", "aggregate t/s krafla", "llama-server", "krafla/llama", "target",
            "p95 TTFT krafla", "llama-server", "p95 <= llama's", "p50 TTFT krafla", "llama-server",
            "t/s per client krafla", "llama-server"]
    lines = [[r["model"], str(r["clients"]), f"{r['aggregate_krafla']:.1f}", f"{r['aggregate_llama']:.1f}",
              f"{r['aggregate_ratio']:.2f}x",
              f">= {r['aggregate_target']:.1f}x {r['aggregate_met']}" if r["aggregate_target"] else "-",
              f"{r['ttft_p95_krafla'] * 1000:.0f} ms", f"{r['ttft_p95_llama'] * 1000:.0f} ms", r["ttft_p95_met"],
              f"{r['ttft_p50_krafla'] * 1000:.0f} ms", f"{r['ttft_p50_llama'] * 1000:.0f} ms",
              f"{r['client_tps_krafla']:.1f}", f"{r['client_tps_llama']:.1f}"] for r in rows]
    return head, lines


def memory_lines(rows):
    head = ["model", "clients", "krafla slots", "krafla RSS", "weights", "KV cache", "RSS / (weights + KV)",
            "target", "llama-server RSS"]
    lines = [[r["model"], str(r["clients"]), str(r["slots"]), mib(r["rss_krafla"]), mib(r["weights"]),
              f"{mib(r['kv'])} ({r['kv_from']})", f"{r['rss_ratio']:.2f}", f"<= {TARGET_MEMORY:.2f} {r['rss_met']}",
              mib(r["rss_llama"])] for r in rows]
    return head, lines


def single_lines(rows):
    head = ["model", "one client: krafla --parallel 1 t/s", "--parallel N t/s", "N / 1 (median of pairs)",
            "quartiles", "pairs", "target"]
    lines = [[r["model"], f"{r['aggregate_parallel_1']:.1f}", f"{r['aggregate_parallel_n']:.1f} (N={r['parallel']})",
              f"{r['ratio']:.3f}", f"{r['ratio_q1']:.3f}–{r['ratio_q3']:.3f}", str(r["pairs"]),
              f">= {TARGET_SINGLE:.2f} {r['met']}"] for r in rows]
    return head, lines


# --- the clients: treq in a reactor running in a thread of its own


class Clients:
    """The Twisted reactor in a background thread; `batch` runs concurrent streamed chats in it and
    waits for them in the calling (main) thread, which keeps Ctrl-C and the server processes."""

    def __enter__(self):
        from twisted.internet import reactor
        from twisted.web.client import HTTPConnectionPool

        self.reactor = reactor
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.thread = threading.Thread(target=reactor.run, kwargs={"installSignalHandlers": False}, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.reactor.callFromThread(self.reactor.stop)
        self.thread.join(10)

    def batch(self, port, contents, max_tokens, timeout):
        """The replies (see batch_figures) of len(contents) chats sent at once."""
        from twisted.internet import defer, error, threads

        def start():
            every = [defer.ensureDeferred(self.chat(port, content, max_tokens)) for content in contents]
            gathered = defer.gatherResults(every, consumeErrors=True)
            return gathered.addTimeout(timeout, self.reactor)

        try:
            return threads.blockingCallFromThread(self.reactor, start)
        except defer.FirstError as e:
            raise SystemExit(f"a chat request failed: {e.subFailure.getErrorMessage()}") from None
        except error.TimeoutError:
            raise SystemExit(f"the {len(contents)} chat requests took more than --timeout {timeout:g} s") from None

    async def chat(self, port, content, max_tokens):
        """One streamed chat completion, timed as it arrives (runs in the reactor thread)."""
        import treq

        reply = {"sent": time.perf_counter(), "first": None, "tokens": 0, "usage": None}
        pending = [b""]

        def received(data):
            now = time.perf_counter()
            reply["end"] = now
            *lines, pending[0] = (pending[0] + data).split(b"\n")
            for line in lines:
                contents, usage = stream_event(line.decode())
                reply["usage"] = usage or reply["usage"]
                if contents:
                    reply["first"] = reply["first"] or now
                    reply["tokens"] += contents

        response = await treq.post(f"http://127.0.0.1:{port}/v1/chat/completions", chat_body(content, max_tokens),
                                   headers={"Content-Type": "application/json"}, pool=self.pool, unbuffered=True)
        if response.code != 200:
            raise RuntimeError(f"HTTP {response.code}: {(await response.content())[:500]!r}")
        await treq.collect(response, received)
        if reply["first"] is None:
            raise RuntimeError("the stream had no content")
        if reply["usage"]:  # the server's count (a delta may hold several tokens)
            reply["tokens"] = reply["usage"]["completion_tokens"]
        return reply


# --- the servers


def resident_bytes(pid):
    """VmRSS of /proc/PID/status in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


@contextlib.contextmanager
def serving(cmd, port, logs, name):
    """A server process started with `cmd`, its output in logs/name.log, once its /health answers;
    stopped on the way out (errors and Ctrl-C included)."""
    log_path = logs / f"{name}.log"
    log("+", " ".join(str(c) for c in cmd))
    with open(log_path, "wb") as out:
        server = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_healthy(server, port, timeout=300)
        except SystemExit as e:
            raise SystemExit(f"{name}: {e}; its log ends:\n{log_path.read_text(errors='replace')[-3000:]}") from None
        yield server, log_path
    finally:
        stop_server(server)


def krafla_command(pulled, port, parallel, args):
    twistd = Path(sys.executable).parent / "twistd"
    extra = [a.replace("{parallel}", str(parallel)) for a in (args.krafla_args or ["--parallel={parallel}"]) if a]
    return [twistd, "-n", "--pidfile=", "--logfile=-", "krafla", pulled.mlb, "-z", pulled.mlt, "--chat", pulled.chat,
            "--port", port, "--ctx", args.ctx, "-t", args.threads, *extra]


def llama_command(gguf, port, parallel, args):
    return [args.llama_bin / "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", port, "-np", parallel,
            "-c", parallel * args.ctx, "-t", args.threads, "-cb", *args.llama_args]


def measure(clients, cmd, port, contents, logs, name, args):
    """Start a server, warm it up, send the batch; its figures with its resident set after the run."""
    with serving(cmd, port, logs, name) as (server, log_path):
        streamed_chat(port, "Warm up.", 8)
        figures = batch_figures(clients.batch(port, contents, args.max_tokens, args.timeout))
        figures["rss"] = resident_bytes(server.pid)
        figures["log"] = log_path.read_text(errors="replace")
    return figures


def krafla_banner(text):
    """The `# krafla ...` banner line of a server log."""
    for line in text.splitlines():
        if "# krafla " in line:
            return line[line.index("# krafla "):]
    raise SystemExit("krafla's log has no '# krafla' banner line")


def model_files(name, args):
    """(krafla's pulled model, the GGUF llama-server runs) on the same weights."""
    from krafla_twisted.cli import models

    if args.weights == "q4_0":
        return llama_gguf(args.vendor, name, args.llama_bin / "llama-quantize")
    return models.pull(name), models.fetch_source(name)


def run_rounds(model_list, args, clients, logs):
    from krafla_twisted.engine.container import ContainerFile

    samples, single = {}, {}
    largest = max(args.clients)
    for round_index in range(args.rounds):
        for name, (pulled, gguf) in model_list.items():
            with ContainerFile(str(pulled.mlb)) as container:
                metadata = dict(container.metadata)
            for count in args.clients:
                contents = prompts(count, round_index, name)
                commands = {"krafla": lambda port: krafla_command(pulled, port, count, args),
                            "llama-server": lambda port: llama_command(gguf, port, count, args)}
                order = ["krafla", "llama-server"] if round_index % 2 == 0 else ["llama-server", "krafla"]
                got = {}
                for who in order:
                    port = free_port()
                    got[who] = measure(clients, commands[who](port), port, contents, logs,
                                       f"{who}-{name}-c{count}-r{round_index}", args)
                krafla = got["krafla"]
                krafla["banner"] = krafla_banner(krafla.pop("log"))
                krafla["slots"], krafla["kv"], krafla["kv_from"] = kv_from_banner(krafla["banner"], metadata)
                krafla["weights"] = pulled.mlb.stat().st_size
                got["llama-server"].pop("log")
                samples.setdefault((name, count), []).append((krafla, got["llama-server"]))
                log(f"round {round_index + 1}/{args.rounds} {name} C={count}: aggregate krafla "
                    f"{krafla['aggregate']:.1f} t/s, llama-server {got['llama-server']['aggregate']:.1f} t/s; p95 TTFT "
                    f"{krafla['ttft_p95'] * 1000:.0f} vs {got['llama-server']['ttft_p95'] * 1000:.0f} ms")
            if args.single:
                pairs = single_pairs(clients, pulled, largest, round_index, name, logs, args)
                single.setdefault(name, []).extend(pairs)
                ratios = ", ".join(f"{n['aggregate'] / one['aggregate']:.3f}" for one, n in pairs)
                log(f"round {round_index + 1}/{args.rounds} {name} one client, --parallel {largest} / --parallel 1 "
                    f"per pair: {ratios}")
    return samples, single


def single_pairs(clients, pulled, largest, round_index, name, logs, args):
    """One client on `--parallel 1` and on `--parallel largest`, both servers up side by side:
    --single-pairs pairs of one request each, the same prompt to both servers within a pair (which
    one goes first alternates), so a pair's ratio compares the same work moments apart. A list of
    (--parallel 1 figures, --parallel largest figures) per pair."""
    with contextlib.ExitStack() as stack:
        ports = {}
        for parallel in (1, largest):
            port = ports[parallel] = free_port()
            stack.enter_context(serving(krafla_command(pulled, port, parallel, args), port, logs,
                                        f"krafla-{name}-single-p{parallel}-r{round_index}"))
            streamed_chat(port, "Warm up.", 8)
        pairs = []
        for pair in range(args.single_pairs):
            contents = prompts(1, round_index * args.single_pairs + pair, f"{name}, one client")
            got = {}
            for parallel in ((1, largest) if pair % 2 == 0 else (largest, 1)):
                got[parallel] = batch_figures(clients.batch(ports[parallel], contents, args.max_tokens, args.timeout))
            pairs.append((got[1], got[largest]))
        return pairs


def comma_integers(text):
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, comma-separated")
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True, metavar="DIR",
                        help="a llama.cpp bin/ holding llama-server (and llama-quantize for --weights q4_0)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="known model names, comma-separated")
    parser.add_argument("--clients", type=comma_integers, default=[1, 4, 8],
                        help="numbers of concurrent clients, comma-separated (default 1,4,8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="reply tokens per request (default 64)")
    parser.add_argument("--ctx", type=int, default=1024, help="context per slot, both servers (default 1024)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--weights", choices=("q4_0", "native"), default="q4_0",
                        help="q4_0: krafla --type q4_0 and the GGUF requantized alike (default); native: krafla's "
                             "default pull and the published GGUF")
    parser.add_argument("--no-single", dest="single", action="store_false",
                        help="skip the one-client comparison of krafla --parallel 1 and --parallel N")
    parser.add_argument("--single-pairs", type=int, default=8,
                        help="requests to each server in the one-client comparison, per round (default 8)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one batch may take (default 600)")
    parser.add_argument("--vendor", type=Path, default=ROOT / "vendor", help="where requantized GGUFs are kept")
    parser.add_argument("--krafla-arg", dest="krafla_args", action="append", default=[],
                        help="krafla server option replacing the default --parallel={parallel} ({parallel} becomes "
                             "the number of slots; --krafla-arg= for none; repeatable)")
    parser.add_argument("--llama-arg", dest="llama_args", action="append", default=[],
                        help="extra llama-server option, e.g. --llama-arg=-nr where the CPU reports AMX but the "
                             "system does not let a process use it (repeatable)")
    parser.add_argument("--json", action="store_true", help="also print every row as JSON")
    args = parser.parse_args(argv)
    needed = ["llama-server"] + (["llama-quantize"] if args.weights == "q4_0" else [])
    missing = [tool for tool in needed if not (args.llama_bin / tool).is_file()]
    if missing:
        parser.error(f"--llama-bin {args.llama_bin}: no {', '.join(missing)} there")
    if min(args.max_tokens, args.threads, args.rounds, args.single_pairs) < 1 or args.ctx < 64:
        parser.error("--max-tokens, -t, --rounds and --single-pairs must be at least 1, --ctx at least 64")
    args.llama_bin, args.vendor = args.llama_bin.resolve(), args.vendor.resolve()
    # SIGTERM unwinds like Ctrl-C, so the servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    model_list = {name: model_files(name, args) for name in args.models.split(",")}
    with tempfile.TemporaryDirectory(prefix="krafla-concurrency-") as logs, Clients() as clients:
        samples, single = run_rounds(model_list, args, clients, Path(logs))
    banner = next(iter(samples.values()))[0][0]["banner"]
    print(f"{args.weights} weights, -t {args.threads}, --ctx {args.ctx} per slot, {args.max_tokens} reply tokens per "
          f"client, T=0, {args.rounds} alternated rounds; krafla: {banner}; llama-server: {args.llama_bin}")
    tables = [concurrency_rows(samples), memory_rows(samples)] + ([single_rows(single, max(args.clients))] if single
                                                                  else [])
    for rows, lines in zip(tables, (concurrency_lines, memory_lines, single_lines)):
        print()
        markdown_table(*lines(rows))
        if args.json:
            for row in rows:
                print(json.dumps(row))
    print(f"(medians over the rounds; a ratio is taken within each round; load average at the end: "
          f"{os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
