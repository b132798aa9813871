"""Start-up configuration: the options of `krafla run` or `twistd krafla` turned into a loaded
generate.Runtime.

    runtime = startup.load_runtime(options)    # an argparse Namespace or the usage.Options mapping

This is where the option table (krafla_twisted/cli/options.py) and the model downloader
(krafla_twisted/cli/models.py) meet the engine: the values are checked, a missing model is the default
one (pulled and converted on first use, with its own chat template unless --chat says otherwise),
a model given without --chat gets the template its tokenizer file names (template_file.py),
and --no-pack / --pack-cache become the Model's arguments. generate.py knows none of this.
"""

import ctypes
import ctypes.util
import inspect
import os

from krafla_twisted.chat import template_file, templates
from krafla_twisted.cli import options
from krafla_twisted.engine import header
from krafla_twisted.generation import generate, speculate


def load_runtime(opts, *, progress=False, parallel=1):
    """Load what the options name: `model` (a .mlb, or None for the default model) and the
    ENGINE_OPTIONS, with `parallel` slots (the server's --parallel; each its own KV cache). Raises ValueError (options.OptionError) for a bad value, clib.KraflaError for a
    bad file, models.PullError when the default model cannot be pulled."""
    from krafla_twisted.engine.model import Model
    from krafla_twisted.engine.tokenizer import Tokenizer

    config = options.validate(options.values(opts))
    model_path = opts.get("model") if hasattr(opts, "keys") else getattr(opts, "model", None)
    chat_name = config["chat"]
    if model_path is None:
        from krafla_twisted.cli import models

        pulled = models.pull(models.DEFAULT_MODEL, progress=progress)
        model_path, config["tokenizer"] = str(pulled.mlb), str(pulled.mlt)
        chat_name = chat_name or pulled.chat
    if config["tokenizer"] is None:
        raise options.OptionError(f"-z TOKENIZER.mlt is required with the model {model_path}")
    packing = packing_arguments(Model, config)
    threads = config["threads"] or options.default_threads()
    template_from = "--chat" if config["chat"] else "the default model" if chat_name else None
    if chat_name == "none":  # --chat none: plain-text prompts whatever the file says
        chat_name = None
    template = templates.get_template(chat_name) if chat_name else None
    check_model_memory(model_path)
    model = Model(model_path, threads=threads, **packing)
    try:
        if config["mlock"]:
            lock_memory()
        eos = config["eos"]
        if eos is not None and not 0 <= eos < model.n_vocab:
            raise options.OptionError(f"--eos {eos} is not a token id of this model (0..{model.n_vocab - 1})")
        tokenizer = Tokenizer(config["tokenizer"])
        if not config["chat"] and template is None:  # the template the tokenizer file names
            chat_name = template_file.template_of(config["tokenizer"])
            template = templates.get_template(chat_name) if chat_name else None
            template_from = "the tokenizer file" if chat_name else None
        sampling = generate.SamplingParams(
            temperature=config["temperature"], top_p=config["top_p"], top_k=config["top_k"],
            repeat_penalty=config["repeat_penalty"], repeat_last_n=config["repeat_last_n"], seed=config["seed"],
            frequency_penalty=config["frequency_penalty"], presence_penalty=config["presence_penalty"],
            min_p=config["min_p"])
        check_kv_memory(model, config, parallel)
        runtime = generate.Runtime(model, tokenizer, template, ctx=config["ctx"], kv=config["kv"], parallel=parallel,
                                   batch=config["batch"], eos=eos, sampling=sampling, max_tokens=config["max_tokens"],
                                   system=config["system"], threads=threads)
        runtime.template_from = template_from
        try:
            runtime.speculation = load_speculation(config, runtime, threads, packing)
        except BaseException:
            runtime.close()
            raise
        return runtime
    except BaseException:
        model.close()
        raise


def load_speculation(config, runtime, threads, packing):
    """The speculate.Speculation --spec and --draft ask for, or None (--spec none without --draft). The
    draft model's tokenizer (--draft-tokenizer, else DRAFT.mlt beside it) must be the model's: a
    draft.DraftError says which token differs."""
    from krafla_twisted.engine.model import Model
    from krafla_twisted.engine.tokenizer import Tokenizer

    draft_path = config["draft"]
    if draft_path is None:
        return speculate.Speculation("lookup") if config["spec"] == "lookup" else None
    tokenizer_path = config["draft_tokenizer"] or os.path.splitext(draft_path)[0] + ".mlt"
    if not os.path.exists(tokenizer_path):
        raise options.OptionError(f"--draft {draft_path}: its tokenizer {tokenizer_path} does not exist; "
                                  "give --draft-tokenizer TOK.mlt")
    draft_model = Model(draft_path, threads=threads, **packing)
    try:
        with Tokenizer(tokenizer_path) as draft_tokenizer:
            speculate.check_same_vocabulary(runtime.tokenizer, draft_tokenizer, runtime.model.n_vocab,
                                            draft_model.n_vocab, draft_path)
        draft = speculate.DraftModel(draft_model, runtime.parallel, ctx=runtime.n_ctx, kv=runtime.kv,
                                     batch=runtime.batch)
    except BaseException:
        draft_model.close()
        raise
    return speculate.Speculation("draft", draft)


# RAM a model must leave free: a tenth of it, at least 1 GiB (the KV cache, the server, the OS).
MEMORY_MARGIN_FRACTION = 0.1
MEMORY_MARGIN_MIN = 1 << 30


def total_memory():
    """MemTotal of /proc/meminfo in bytes, or None where there is none."""
    return _meminfo("MemTotal:")


def check_model_memory(model_path, total=None):
    """Refuse, giving both sizes, a model file larger than the machine's RAM less a margin: its
    weights would be paged in and out of the file at every step (a mixture of experts only reads
    some of them per token, but every expert is read sooner or later)."""
    total = total_memory() if total is None else total
    try:
        size = os.path.getsize(model_path)
    except OSError:
        return  # the Model reports a missing or unreadable file itself
    if total is None:
        return
    margin = max(MEMORY_MARGIN_MIN, int(total * MEMORY_MARGIN_FRACTION))
    if size > total - margin:
        raise options.OptionError(
            f"{model_path} is {size / 2**30:.1f} GiB, more than this machine's {total / 2**30:.1f} GiB of RAM less "
            f"a {margin / 2**30:.1f} GiB margin: use a smaller quantization of the model")


def lock_memory():
    """--mlock: lock every page the process has mapped now (the model's weights; not the KV caches
    allocated after) into RAM, so they are never paged out."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    mcl_current = 1
    if libc.mlockall(mcl_current) != 0:
        code = ctypes.get_errno()
        raise options.OptionError(f"--mlock: cannot lock the model in memory ({os.strerror(code)}); raise the "
                                  "locked-memory limit (ulimit -l, LimitMEMLOCK=) or leave --mlock out")


def available_memory():
    """MemAvailable of /proc/meminfo in bytes, or None where there is none."""
    return _meminfo("MemAvailable:")


def _meminfo(key):
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_kv_memory(model, config, parallel):
    """Refuse, naming the options, a --parallel x --ctx KV cache larger than the memory available now."""
    n_ctx = config["ctx"] or min(model.max_seq, header.KR_DEFAULT_MAX_CTX)
    needed = parallel * generate.kv_cache_bytes(model, n_ctx, config["kv"])
    available = available_memory()
    if available is not None and needed > available:
        raise options.OptionError(
            f"--parallel {parallel} x --ctx {n_ctx} needs {needed / 2**30:.1f} GiB of KV cache (kv {config['kv']}), "
            f"but only {available / 2**30:.1f} GiB of memory is available: lower --parallel or --ctx, or use "
            "--kv q8_0")


def packing_arguments(model_class, config):
    """Model keyword arguments for --no-pack / --pack-cache. An engine without weight repacking
    already runs on the file's layout (what --no-pack asks for); --pack-cache is refused there
    rather than silently ignored."""
    parameters = inspect.signature(model_class).parameters
    if "pack" in parameters:
        return {"pack": not config["no_pack"], "pack_cache": config["pack_cache"]}
    if config["pack_cache"] and not config["no_pack"]:
        raise options.OptionError("--pack-cache: this engine build does not repack weights, so there is "
                                  "nothing to cache; leave the option out")
    return {}
