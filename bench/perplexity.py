"""Perplexity of krafla's default conversion against llama.cpp on the published file (issue 13).

    .venv/bin/python bench/perplexity.py --llama-bin /work/llama/build-native/bin
    .venv/bin/python bench/perplexity.py --llama-bin DIR --models smollm2-135m --q4_0 --chunks 4
    .venv/bin/python bench/perplexity.py --llama-bin DIR --moe smollm2-135m --chunks 4 -t 1

For each known model (`krafla pull`'s three published GGUFs), on one English text
(bench/data/devils-dictionary.txt, public domain, by default):

- llama.cpp: `llama-perplexity -m SOURCE.gguf -f TEXT -c CTX --chunks N -t T` on the GGUF as
  published (its final estimate, PPL ± error);
- krafla: `krafla perplexity MODEL.mlb -z MODEL.mlt -f TEXT --ctx CTX --chunks N -t T --json` on
  the model `krafla pull NAME` makes by default (the file's own types where the engine computes on
  them; the table names the type it got);
- with --q4_0 also llama.cpp on the file's Q4_0 requantization (`llama-quantize --allow-requantize
  SOURCE OUT Q4_0`) and krafla on `krafla pull NAME --type q4_0`, the rows of issue 13's table.

- with --types q2_K,q3_K,iq4_nl,iq4_xs,mxfp4 the low-bit types instead: for each, the published
  file requantized by `llama-quantize --allow-requantize SOURCE OUT FTYPE` (Q2_K, Q3_K_M, IQ4_NL,
  IQ4_XS; for mxfp4 `--tensor-type` puts every layer matrix in MXFP4 over a Q8_0 file, as
  MXFP4_MOE does to a MoE model's experts), then llama.cpp and krafla on that same file (krafla
  through `krafla convert OUT`, which keeps its blocks). The table names the file's types.

- with --moe MODEL (smollm2-135m) a mixture of experts that predicts text instead: the dense llama
  MODEL upcycled into a Mixtral-style GGUF, f16, every width whole 256-value super-blocks
  (bench/moe_model.py --upcycle), then llama-quantize's Q2_K, Q3_K_M, IQ4_NL, IQ4_XS and
  MXFP4_MOE files of it (--types chooses among them), and llama.cpp and krafla on the f16 file
  and on each of those, as for --types. A second table names each tensor role's types.

It prints the table with krafla's default over llama.cpp on the published file, whose target is
at most 1.01 (within 1%); in the low-bit tables, where both programs read the same file, within
1% either way (0.99 to 1.01). Perplexity does not depend on the machine's load: one run suffices.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from compare import log, markdown_table, requantized, run  # bench/compare.py, beside this script

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")
DEFAULT_TEXT = ROOT / "bench" / "data" / "devils-dictionary.txt"
TARGET = 1.01  # krafla's default / llama.cpp on the published file
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
RUNNING = re.compile(r"\[([0-9]+)\]([0-9.]+),")  # llama-perplexity's estimate after each chunk: [1]307.1846,


def llama_perplexity(binaries, gguf, args):
    """(PPL, error, the estimate after each chunk) from llama-perplexity's output."""
    cmd = [binaries / "llama-perplexity", "-m", gguf, "-f", args.text, "-c", args.ctx, "--chunks", args.chunks,
           "-t", args.threads, *args.llama_args]
    log("+", " ".join(str(c) for c in cmd))
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    estimate = None if done.returncode else llama_estimate(done.stdout + done.stderr)
    if estimate is None:
        raise SystemExit(f"llama-perplexity on {gguf} failed (status {done.returncode}):\n{done.stderr[-2000:]}")
    return estimate


def llama_estimate(output):
    """(PPL, error, the estimate after each chunk) from llama-perplexity's output, or None
    without its final estimate."""
    match = FINAL.search(output)
    if not match:
        return None
    running = [float(value) for _, value in sorted((int(i), value) for i, value in RUNNING.findall(output))]
    return float(match.group(1)), float(match.group(2)), running


def krafla_perplexity(pulled, args):
    """(PPL, error, weight type, the estimate after each chunk) from `krafla perplexity --json`."""
    from krafla_twisted.engine.model import Model

    with Model(pulled.mlb) as model:
        weight_type = model.weight_type
    cmd = [sys.executable, "-m", "krafla_twisted.cli.main", "perplexity", pulled.mlb, "-z", pulled.mlt, "-f", args.text,
           "--ctx", args.ctx, "--chunks", args.chunks, "-t", args.threads, "--json"]
    log("+", " ".join(str(c) for c in cmd))
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"krafla perplexity on {pulled.mlb} failed (status {done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    return result["perplexity"], result["error"], weight_type, result["running"]


def chunk_log_perplexities(running):
    """Each chunk's own mean negative log-likelihood, from the estimates after each chunk (every
    chunk scores as many tokens): chunk i's is i log r_i - (i - 1) log r_(i-1)."""
    logs = np.log(np.asarray(running, np.float64))
    return np.diff(np.arange(1, len(logs) + 1) * logs, prepend=0.0)  # the running sums' steps


def ratio_error(llama_running, krafla_running):
    """The standard error of log(krafla / llama) over the chunks (their per-chunk differences'
    standard deviation over the square root of their number), or None for fewer than 2 chunks:
    how far the ratio moves with the text, since a quantized model's two evaluations differ
    token by token (the rounding of the activations) far more than the final ratio shows."""
    if len(llama_running) != len(krafla_running) or len(llama_running) < 2:
        return None
    differences = chunk_log_perplexities(krafla_running) - chunk_log_perplexities(llama_running)
    return float(np.std(differences, ddof=1) / np.sqrt(len(differences)))


def q4_0_gguf(binaries, source, vendor):
    """The published GGUF requantized by llama-quantize to Q4_0 (made once under vendor/)."""
    return requantized(binaries / "llama-quantize", source, vendor / "gguf" / f"{Path(source).stem}-requant-Q4_0.gguf")


# krafla type -> llama-quantize's arguments after SOURCE OUT: the file type, with options before it
LOW_BIT_QUANTIZE = {
    "q2_K": ((), "Q2_K"),
    "q3_K": ((), "Q3_K_M"),
    "iq4_nl": ((), "IQ4_NL"),
    "iq4_xs": ((), "IQ4_XS"),
    "mxfp4": (("--tensor-type", r"blk\.[0-9]+\.(attn|ffn)_[a-z]+\.weight=mxfp4"), "Q8_0"),
}


# the same for the upcycled MoE (--moe), from its f16: llama-quantize's own file types, MXFP4_MOE
# putting the experts in MXFP4 and the other matrices in Q8_0
MOE_QUANTIZE = {"q2_K": ((), "Q2_K"), "q3_K": ((), "Q3_K_M"), "iq4_nl": ((), "IQ4_NL"), "iq4_xs": ((), "IQ4_XS"),
                "mxfp4": ((), "MXFP4_MOE")}


def low_bit_gguf(binaries, source, vendor, type_name, recipes=LOW_BIT_QUANTIZE):
    """The GGUF `source` quantized by llama-quantize for `type_name` as `recipes` says (made once
    under vendor/)."""
    options, file_type = recipes[type_name]
    out = vendor / "gguf" / f"{Path(source).stem}-requant-{type_name}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        run([binaries / "llama-quantize", "--allow-requantize", *options, source, partial, file_type],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        partial.rename(out)
    return out


def matrix_types(gguf_path):
    """{role: {ggml type name: count}} of a GGUF's matrices (the router, kept f32, left out); a
    role is the tensor name without its layer (`blk.3.attn_q.weight` -> `attn_q`)."""
    import gguf

    roles = {}
    for tensor in gguf.GGUFReader(gguf_path).tensors:
        if len(tensor.shape) >= 2 and "ffn_gate_inp" not in tensor.name:
            role = re.sub(r"^blk\.[0-9]+\.", "", tensor.name).removesuffix(".weight")
            counts = roles.setdefault(role, {})
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return roles


def measure_file(model, type_name, gguf_path, binaries, args):
    """llama.cpp and krafla on one GGUF (krafla through `krafla convert`, which keeps its blocks):
    a row of the low-bit tables."""
    from krafla_twisted.convert.gguf import convert_gguf

    mlb, mlt = gguf_path.with_suffix(".mlb"), gguf_path.with_suffix(".mlt")
    if not mlb.is_file() or not mlt.is_file():
        convert_gguf(gguf_path, mlb, mlt, progress=False)
    row = {"model": model, "type": type_name, "roles": matrix_types(gguf_path)}
    row["llama"] = llama_perplexity(binaries, gguf_path, args)
    row["krafla"] = krafla_perplexity(SimpleNamespace(mlb=mlb, mlt=mlt), args)
    row["ratio"] = row["krafla"][0] / row["llama"][0]
    row["ratio_error"] = ratio_error(row["llama"][2], row["krafla"][3])
    return row


def measure_low_bit(name, type_name, binaries, args):
    """llama.cpp and krafla on the known model's llama-quantize file for `type_name`."""
    from krafla_twisted.cli import models

    requant = low_bit_gguf(binaries, models.fetch_source(name), args.vendor, type_name)
    return measure_file(name, type_name, requant, binaries, args)


def upcycled_gguf(name, vendor):
    """The known dense llama model made a mixture of experts, f16 (bench/moe_model.py's
    upcycle_gguf, its defaults; made once under vendor/moe/)."""
    from moe_model import upcycle_gguf  # bench/moe_model.py, beside this script

    from krafla_twisted.cli import models

    out = vendor / "moe" / f"{name}-upcycled.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        log(f"upcycling {name} into {out}")
        upcycle_gguf(partial, models.fetch_source(name))
        partial.rename(out)
    return out


def measure_moe(name, type_names, binaries, args):
    """The rows of the MoE table, one by one: the upcycled f16 file, then its llama-quantize file
    per type."""
    upcycled = upcycled_gguf(name, args.vendor)
    yield measure_file(f"{name} upcycled", "f16", upcycled, binaries, args)
    for type_name in type_names:
        quantized = low_bit_gguf(binaries, upcycled, args.vendor, type_name, MOE_QUANTIZE)
        yield measure_file(f"{name} upcycled", type_name, quantized, binaries, args)


def within_target(ratio):
    """Both programs read the same file: krafla's perplexity within 1% of llama.cpp's either way."""
    return 2 - TARGET <= ratio <= TARGET


def print_low_bit_table(rows, args, recipes=LOW_BIT_QUANTIZE):
    def cell(value):
        return f"{value[0]:.2f} ± {value[1]:.2f}"

    def counted(counts):
        return ", ".join(f"{count} {t}" for t, count in sorted(counts.items(), key=lambda item: -item[1]))

    head = ["model", "llama-quantize", "the file's matrices", "llama.cpp", "krafla", "krafla / llama.cpp",
            f"target {2 - TARGET:.2f}..{TARGET:.2f}"]
    lines = []
    for row in rows:
        options, file_type = recipes.get(row["type"], ((), "none (f16 as written)"))
        totals = {}
        for counts in row["roles"].values():
            for type_name, count in counts.items():
                totals[type_name] = totals.get(type_name, 0) + count
        lines.append([row["model"], file_type + (" + MXFP4 layers" if options else ""), counted(totals),
                      cell(row["llama"]), cell(row["krafla"]),
                      f"{row['ratio']:.4f}" + (f" ± {row['ratio_error']:.4f}" if row.get("ratio_error") else ""),
                      "met" if within_target(row["ratio"]) else "NOT met"])
    markdown_table(head, lines)
    print(f"(perplexity ± its error, -c {args.ctx} --chunks {args.chunks}, -t {args.threads}, on "
          f"{Path(args.text).name}; both on the same GGUF; the ratio ± the standard error of its log over the chunks)")
    roles = sorted({role for row in rows for role in row["roles"]})
    print()
    markdown_table(["file"] + roles, [[recipes.get(row["type"], ((), "f16"))[1]] +
                                      [counted(row["roles"].get(role, {})) for role in roles] for row in rows])
    print("(each role's matrices by type; the router ffn_gate_inp and the norms stay f32)")


def measure(name, binaries, args):
    from krafla_twisted.cli import models

    source = models.fetch_source(name)
    row = {"model": name, "source": source.name}
    row["llama"] = llama_perplexity(binaries, source, args)
    row["krafla"] = krafla_perplexity(models.pull(name), args)
    if args.q4_0:
        row["llama_q4_0"] = llama_perplexity(binaries, q4_0_gguf(binaries, source, args.vendor), args)
        row["krafla_q4_0"] = krafla_perplexity(models.pull(name, type_name="q4_0"), args)
    row["ratio"] = row["krafla"][0] / row["llama"][0]
    return row


def print_table(rows, args):
    def cell(value):
        return f"{value[0]:.2f} ± {value[1]:.2f}"

    head = ["model (file as published)", "llama.cpp on that file"]
    if args.q4_0:
        head += ["llama.cpp on its Q4_0 requant", "krafla --type q4_0"]
    head += ["krafla's default", "krafla / llama.cpp", f"target <= {TARGET:.2f}"]
    lines = []
    for row in rows:
        line = [f"{row['model']} ({row['source']})", cell(row["llama"])]
        if args.q4_0:
            line += [cell(row["llama_q4_0"]), cell(row["krafla_q4_0"])]
        line += [f"{cell(row['krafla'])} ({row['krafla'][2]})", f"{row['ratio']:.4f}",
                 "met" if row["ratio"] <= TARGET else "NOT met"]
        lines.append(line)
    markdown_table(head, lines)
    print(f"(perplexity ± its error, -c {args.ctx} --chunks {args.chunks}, -t {args.threads}, on "
          f"{Path(args.text).name}; krafla's default: the type in brackets is what `krafla pull` made)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True, metavar="DIR",
                        help="a llama.cpp bin/ holding llama-perplexity (and llama-quantize for --q4_0)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="known model names, comma-separated")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help=f"the text (default {DEFAULT_TEXT.name})")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    parser.add_argument("--chunks", type=int, default=8, help="chunks scored (default 8)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--q4_0", action="store_true", help="also the Q4_0 requantizations (llama.cpp and krafla)")
    parser.add_argument("--types", default=None, metavar="T,T",
                        help=f"instead, the low-bit types' requantizations ({', '.join(LOW_BIT_QUANTIZE)})")
    parser.add_argument("--moe", metavar="MODEL", default=None,
                        help="instead, the known dense llama MODEL (smollm2-135m) upcycled into a mixture of "
                             "experts (bench/moe_model.py --upcycle) and llama-quantize's files of it for --types "
                             "(default all)")
    parser.add_argument("--vendor", type=Path, default=ROOT / "vendor", help="where requantized GGUFs are kept")
    parser.add_argument("--json", action="store_true", help="also print each row as JSON")
    parser.add_argument("--llama-arg", dest="llama_args", action="append", default=[],
                        help="extra option for llama-perplexity, e.g. --llama-arg=-nr where the CPU reports AMX "
                             "but the system does not let a process use it (repeatable)")
    args = parser.parse_args(argv)
    needed = ["llama-perplexity"] + (["llama-quantize"] if args.q4_0 or args.types or args.moe else [])
    missing = [tool for tool in needed if not (args.llama_bin / tool).is_file()]
    if missing:
        parser.error(f"--llama-bin {args.llama_bin}: no {', '.join(missing)} there")
    if not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    if args.ctx < 8 or args.chunks < 1 or args.threads < 1:
        parser.error("--ctx must be at least 8, --chunks and -t at least 1")
    args.vendor = args.vendor.resolve()
    rows = []
    if args.types:
        unknown = [t for t in args.types.split(",") if t not in LOW_BIT_QUANTIZE]
        if unknown:
            parser.error(f"--types: {', '.join(unknown)} not among {', '.join(LOW_BIT_QUANTIZE)}")
    if args.moe:
        for row in measure_moe(args.moe, (args.types or ",".join(MOE_QUANTIZE)).split(","), args.llama_bin.resolve(),
                               args):
            rows.append(row)
            log(f"{row['model']} {row['type']}: {row}")
            if args.json:
                print(json.dumps(row), flush=True)
        print_low_bit_table(rows, args, MOE_QUANTIZE)
        return 0
    if args.types:
        for name in args.models.split(","):
            for type_name in args.types.split(","):
                rows.append(measure_low_bit(name, type_name, args.llama_bin.resolve(), args))
                log(f"{name} {type_name}: {rows[-1]}")
                if args.json:
                    print(json.dumps(rows[-1]), flush=True)
        print_low_bit_table(rows, args)
        return 0
    for name in args.models.split(","):
        rows.append(measure(name, args.llama_bin.resolve(), args))
        log(f"{name}: {rows[-1]}")
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
