"""How long a running stream pauses while the server reads a long prompt beside it, per --batch.

    .venv/bin/python bench/prompt_stall.py --models smollm2-135m --batches 32,64,128 --rounds 2

For each model, --batch value and round: `twistd -n krafla --parallel 2 --batch B` on the pulled
model (krafla's default pull of the model, its chat template). One streamed chat reply runs
(T=0, 200 tokens, ignore_eos); once it streams, a second chat request with a prompt of about 1000
tokens arrives. Measured by the client: the running stream's usual gap between two content events
(median before the long prompt came), its longest gap while the long prompt is read (from sending
it to its first content event), and the long prompt's time to first token. A step takes the
replies' tokens first and at most --batch tokens in all, so the longest gap grows with --batch
while the long prompt's time to first token shrinks (fewer, wider steps).
"""

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from compare import chat_body, free_port, log, markdown_table, stop_server, stream_event, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
RUNNING = "Count from 1 to 500, one number per line."
LONG = "Summarize this list: " + " ".join(f"Item {i} is a word about the sea." for i in range(120))


def running_stream(port, times, streaming, ordinary=10):
    """A 200-token greedy reply; appends the time of each content event to `times` and sets
    `streaming` once `ordinary` events came (their gaps are the usual ones)."""
    body = json.dumps({"messages": [{"role": "user", "content": RUNNING}], "stream": True, "max_tokens": 200,
                       "temperature": 0, "ignore_eos": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    for raw in conn.getresponse():
        if stream_event(raw.decode())[0]:
            times.append(time.perf_counter())
            if len(times) >= ordinary:
                streaming.set()
    conn.close()


def long_prompt(port):
    """(when the request was sent, when its first content event came), perf_counter seconds."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", chat_body(LONG, 4), {"Content-Type": "application/json"})
    first = None
    for raw in conn.getresponse():
        if stream_event(raw.decode())[0] and first is None:
            first = time.perf_counter()
    conn.close()
    if first is None:
        raise SystemExit("the long prompt's reply had no content")
    return start, first


def measure(pulled, batch, args):
    port = free_port()
    twistd = Path(sys.executable).parent / "twistd"
    cmd = [str(twistd), "-n", "--pidfile=", "--logfile=-", "krafla", str(pulled.mlb), "-z", str(pulled.mlt),
           "--chat", pulled.chat, "--port", str(port), "--ctx", "2048", "-t", str(args.threads), "--parallel", "2",
           "--batch", str(batch)]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(server, port, timeout=300)
        times, streaming = [], threading.Event()
        stream = threading.Thread(target=running_stream, args=(port, times, streaming))
        stream.start()
        streaming.wait(300)
        sent, first = long_prompt(port)
        stream.join()
    finally:
        stop_server(server)
    gaps = list(zip(times, times[1:]))
    usual = statistics.median(b - a for a, b in gaps if b < sent)
    during = [b - a for a, b in gaps if b > sent and a < first]
    return {"usual_ms": usual * 1e3, "longest_ms": max(during, default=0.0) * 1e3, "ttft_ms": (first - sent) * 1e3}


def main():
    from krafla_twisted.cli import models

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m", help="known model names, comma-separated")
    parser.add_argument("--batches", default="32,64,128", help="--batch values, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        pulled = models.pull(name)
        results = {}
        for round_ in range(args.rounds):
            for batch in map(int, args.batches.split(",")):
                figures = measure(pulled, batch, args)
                log(f"round {round_ + 1}/{args.rounds} {name} --batch {batch}: longest gap {figures['longest_ms']:.0f} ms "
                    f"(usual {figures['usual_ms']:.1f} ms), long prompt's first token after {figures['ttft_ms']:.0f} ms")
                results.setdefault(batch, []).append(figures)
        for batch, runs in results.items():
            rows.append([name, str(batch)] + [f"{statistics.median(r[key] for r in runs):.{digits}f} ms"
                                               for key, digits in (("usual_ms", 1), ("longest_ms", 0), ("ttft_ms", 0))])
    markdown_table(["model", "--batch", "usual gap", "longest gap while the prompt is read", "long prompt's first token"],
                   rows)
    print(f"(medians over {args.rounds} rounds; -t {args.threads}, --parallel 2, a prompt of about 1000 tokens)")


if __name__ == "__main__":
    main()
