"""Speculative decoding: krafla with and without it on a code-editing task and a chat task (issue 29).

    .venv/bin/python bench/spec.py                                   # SmolLM2 and Qwen2.5-Coder, 3 rounds
    .venv/bin/python bench/spec.py --models smollm2-135m --rounds 2 --max-tokens 120
    .venv/bin/python bench/spec.py --draft-for qwen2.5-coder-0.5b=smollm2-135m   # (same tokenizer only)

Two tasks, each a few prompts sent as chats, greedy:
- code: the prompt holds a function and asks for a small change (a rename, one more parameter, a
  changed constant); the reply rewrites the function, copying most of it from the prompt;
- chat: open questions whose replies copy nothing from the prompt.

For each model, in one process, one Runtime per mode on the same model file: `none` (no
speculation), `lookup` (--spec lookup), and `draft` when --draft-for names a draft for that model.
Each round runs every prompt of both tasks in every mode (the order of the modes rotates by round),
each from an empty cache, and checks that every mode's reply is the tokens `none` gives (the same
bits is the point of the design). The figure per task and mode is reply tokens / reply seconds (after
the prompt) summed over the task's prompts; the ratio to `none` is taken within each round and the
table shows its median over the rounds (the machine is shared: lone speeds say little), with the
acceptance (accepted / proposed tokens). Issue 29's targets: code >= 2x, chat >= 0.97x.

With --llama-bin DIR (a llama.cpp build's bin/), llama-server runs the same prompts on the published
GGUF that krafla's default pull converts (`models.fetch_source`), started once per mode and kept up
for the whole run: `llama` (no speculation) and `llama-lookup` (`--spec-type ngram-simple`, its
prompt lookup; options from --llama-spec-arg), plus `llama-draft` (`-md DRAFT.gguf`) with
--draft-for. Its reply speed is the `timings` it reports (predicted_n / predicted_ms); the table
adds krafla's speculation against llama-server's own (`lookup` / `llama-lookup`, and `draft` /
`llama-draft`), again within each round. Issue 29's target there: code >= 1.5x.
"""

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compare import free_port, stop_server, wait_healthy  # noqa: E402  (bench/compare.py)

from krafla_twisted.chat import templates  # noqa: E402
from krafla_twisted.cli import models  # noqa: E402
from krafla_twisted.engine.model import Model  # noqa: E402
from krafla_twisted.engine.tokenizer import Tokenizer  # noqa: E402
from krafla_twisted.generation.generate import Generator, Runtime, SamplingParams, build_prompt  # noqa: E402
from krafla_twisted.generation.speculate import DraftModel, Speculation, check_same_vocabulary  # noqa: E402

TARGETS = {"code": 2.0, "chat": 0.97}
TARGET_AGAINST_LLAMA = {"code": 1.5}
PEERS = {"lookup": "llama-lookup", "draft": "llama-draft"}  # krafla mode -> llama-server's like it

FUNCTIONS = [
    '''def summarize_orders(orders, tax_rate):
    """Totals per customer, with tax, skipping cancelled orders."""
    totals = {}
    for order in orders:
        if order.status == "cancelled":
            continue
        amount = order.quantity * order.unit_price
        amount = amount + amount * tax_rate
        customer = order.customer_id
        if customer not in totals:
            totals[customer] = 0.0
        totals[customer] += amount
    result = []
    for customer, total in sorted(totals.items()):
        result.append({"customer": customer, "total": round(total, 2)})
    return result
''',
    '''def parse_config(lines):
    """key = value lines into a dict; # starts a comment, blank lines are skipped."""
    config = {}
    for number, line in enumerate(lines, start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value, got {line!r}")
        key, value = line.split("=", 1)
        key = key.strip()
        value = value.strip()
        if key in config:
            raise ValueError(f"line {number}: {key} is set twice")
        config[key] = value
    return config
''',
    '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        if index >= window - 1:
            averages.append(running / window)
    return averages
''',
]
CHANGES = ["Rename the variable `{var}` to `{new}` everywhere in this function and give back the whole "
           "function, nothing else.\n\n```python\n{code}```",
           "Add a docstring line saying who wrote it (Ada) to this function and give back the whole function, "
           "nothing else.\n\n```python\n{code}```",
           "Rename the variable `{var}` to `{new}` everywhere in this function and give back the whole "
           "function, nothing else.\n\n```python\n{code}```"]
RENAMES = [("totals", "sums"), ("config", "settings"), ("running", "window_sum")]

CHATS = ["What are three good habits for a beginner learning to play the guitar?",
         "Explain in a few sentences why the sky is blue.",
         "Write a short story about a lighthouse keeper who finds a message in a bottle."]


def tasks():
    code = [CHANGES[i].format(var=RENAMES[i][0], new=RENAMES[i][1], code=FUNCTIONS[i]) for i in range(len(FUNCTIONS))]
    return {"code": code, "chat": CHATS}


def runtime(pulled, speculation):
    model = Model(str(pulled.mlb), threads=ARGS.threads)
    return Runtime(model, Tokenizer(str(pulled.mlt)), templates.get_template(pulled.chat), ctx=2048, batch=64,
                   speculation=speculation)


def draft_speculation(target, draft_name):
    draft = models.pull(draft_name, progress=True)
    with Tokenizer(str(target.mlt)) as mine, Tokenizer(str(draft.mlt)) as theirs:
        check_same_vocabulary(mine, theirs, mine.n_vocab, theirs.n_vocab, draft.mlb)
    model = Model(str(draft.mlb), threads=ARGS.threads)
    return Speculation("draft", DraftModel(model, 1, ctx=2048))


class LlamaServer:
    """One llama-server on a GGUF, up until close(); `reply(ask)` -> (tokens, seconds, token ids or None)."""

    def __init__(self, gguf, extra):
        self.port = free_port()
        command = [str(Path(ARGS.llama_bin) / "llama-server"), "-m", str(gguf), "--port", str(self.port), "-c", "2048",
                   "-t", str(ARGS.threads), "-np", "1", "--temp", "0", *extra]
        print("+ " + " ".join(command), file=sys.stderr, flush=True)
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(self.process, self.port, timeout=300)

    def reply(self, ask):
        body = json.dumps({"messages": [{"role": "user", "content": ask}], "max_tokens": ARGS.max_tokens,
                           "temperature": 0, "cache_prompt": False}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        if response.status != 200:
            raise SystemExit(f"llama-server: HTTP {response.status}: {answer}")
        timings = answer["timings"]
        drafted, taken = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
        return timings["predicted_n"], timings["predicted_ms"] / 1000, drafted, taken

    def close(self):
        stop_server(self.process)


def llama_servers(name):
    if not ARGS.llama_bin:
        return {}
    gguf = models.fetch_source(name, progress=True)
    servers = {"llama": LlamaServer(gguf, []), "llama-lookup": LlamaServer(gguf, ARGS.llama_spec_arg)}
    if name in ARGS.drafts:
        servers["llama-draft"] = LlamaServer(gguf, ["-md", str(models.fetch_source(ARGS.drafts[name]))])
    return servers


def measure(name):
    pulled = models.pull(name, progress=True)
    modes = {"none": runtime(pulled, None), "lookup": runtime(pulled, Speculation("lookup"))}
    if name in ARGS.drafts:
        modes["draft"] = runtime(pulled, draft_speculation(pulled, ARGS.drafts[name]))
    peers = llama_servers(name)
    order = list(modes) + list(peers)
    figures = {task: {mode: [] for mode in order} for task in tasks()}   # per round: (tokens, seconds, prop, acc)
    try:
        for round_index in range(ARGS.rounds):
            rotation = order[round_index % len(order):] + order[:round_index % len(order)]
            for task, asks in tasks().items():
                sums = {mode: [0, 0.0, 0, 0] for mode in order}
                for ask in asks:
                    replies = {}
                    for mode in rotation:
                        if mode in peers:
                            sums[mode] = [a + b for a, b in zip(sums[mode], peers[mode].reply(ask))]
                            continue
                        rt = modes[mode]
                        prompt = build_prompt(rt, messages=[{"role": "user", "content": ask}])
                        rt.reset()
                        result = Generator(rt).generate(prompt.tokens, max_tokens=ARGS.max_tokens,
                                                        sampling=SamplingParams(), stop_strings=prompt.stop_strings)
                        replies[mode] = result.tokens
                        total = sums[mode]
                        total[0] += result.completion_tokens
                        total[1] += result.generation_seconds
                        total[2] += result.proposed_tokens
                        total[3] += result.accepted_tokens
                    for mode, tokens in replies.items():
                        if tokens != replies["none"]:
                            raise SystemExit(f"{name} {task}: the {mode} reply differs from the reply without "
                                             f"speculation for {ask[:40]!r}")
                for mode in order:
                    figures[task][mode].append(tuple(sums[mode]))
                line = ", ".join(f"{mode} {t / s:.1f} t/s" for mode, (t, s, _, _) in sums.items())
                print(f"# {name} round {round_index + 1} {task}: {line}", file=sys.stderr, flush=True)
    finally:
        for rt in modes.values():
            rt.close()
        for server in peers.values():
            server.close()
    return figures


def table(results):
    lines = ["| model | task | mode | reply t/s (median) | × none (median of rounds, range) | accepted / proposed | target |",
             "|---|---|---|---|---|---|---|"]
    for name, figures in results.items():
        for task, by_mode in figures.items():
            base = by_mode["none"]
            for mode, rounds in by_mode.items():
                speeds = [t / s for t, s, _, _ in rounds]
                ratios = [(t / s) / (bt / bs) for (t, s, _, _), (bt, bs, _, _) in zip(rounds, base)]
                proposed = sum(r[2] for r in rounds)
                accepted = sum(r[3] for r in rounds)
                ratio = statistics.median(ratios)
                if mode == "none":
                    cells = ["1", "-", ""]
                elif mode.startswith("llama"):
                    cells = [f"{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                             f"{accepted}/{proposed}" if proposed else "-", ""]
                else:
                    met = "met" if ratio >= TARGETS[task] else "NOT met"
                    cells = [f"{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                             f"{accepted}/{proposed} ({100 * accepted / max(proposed, 1):.0f}%)",
                             f"≥ {TARGETS[task]}× {met}"]
                lines.append(f"| {name} | {task} | {mode} | {statistics.median(speeds):.1f} | " + " | ".join(cells) + " |")
    against = [(name, task, mine, peer, by_mode) for name, figures in results.items() for task, by_mode in figures.items()
               for mine, peer in PEERS.items() if mine in by_mode and peer in by_mode]
    if against:
        lines += ["", "| model | task | krafla / llama-server (median of rounds, range) | target |", "|---|---|---|---|"]
        for name, task, mine, peer, by_mode in against:
            ratios = [(t / s) / (pt / ps) for (t, s, _, _), (pt, ps, _, _) in zip(by_mode[mine], by_mode[peer])]
            ratio = statistics.median(ratios)
            target = TARGET_AGAINST_LLAMA.get(task)
            met = f"≥ {target}× {'met' if ratio >= target else 'NOT met'}" if target else ""
            lines.append(f"| {name} | {task} | {mine} / {peer}: {ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {met} |")
    return "\n".join(lines)


def main(argv=None):
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-for", action="append", default=[], metavar="MODEL=DRAFT",
                        help="also measure --draft DRAFT (a known model name) for MODEL")
    parser.add_argument("--llama-bin", help="a llama.cpp build's bin/ folder: measure llama-server too")
    parser.add_argument("--llama-spec-arg", action="append", default=None,
                        help="one of llama-server's lookup options, repeated for each word, as --llama-spec-arg=--spec-type "
                             "--llama-spec-arg=ngram-simple (the default)")
    ARGS = parser.parse_args(argv)
    ARGS.drafts = dict(item.split("=", 1) for item in ARGS.draft_for)
    ARGS.llama_spec_arg = ARGS.llama_spec_arg or ["--spec-type", "ngram-simple"]
    started = time.time()
    results = {name: measure(name) for name in ARGS.models.split(",")}
    print(f"bench/spec.py {' '.join(argv if argv is not None else sys.argv[1:])}: "
          f"{ARGS.rounds} rounds, --max-tokens {ARGS.max_tokens}, -t {ARGS.threads}, {time.time() - started:.0f} s")
    print(table(results))


ARGS = None

if __name__ == "__main__":
    main()
