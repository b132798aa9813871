"""The models of `twistd krafla --models FILE` or `--models-dir DIR`, read into ModelSpecs.

A models file is TOML (read with tomllib) or, named .yaml/.yml, YAML (when PyYAML is installed):
a list `models` of tables, each

    name        the model's id: what a request's `model` field names (required)
    file        its .mlb, or a .gguf (converted once, on its first load, into $KRAFLA_HOME/converted)
                (required; relative to the models file's folder)
    tokenizer   its .mlt (default: the .mlb's name with .mlt; a .gguf's own)
    chat        its chat template (default: the one its tokenizer file names)
    ctx, parallel, kv, threads    as the options of that name, for this model (default: the command line's)
    aliases     other names requests may use for it
    embeddings  true for an embedding model (served at /v1/embeddings, /v1/rerank; then `pooling` too;
                `pooling = "rank"`, a decoder reranker, implies it)

`--models-dir DIR` serves every .mlb and .gguf in DIR, each named by its file name without .mlb, with its
tokenizer beside it and the command line's options (an encoder's file, BERT-family, is served as an
embedding model). The memory a model needs is estimated as its
file's size plus its KV cache (parallel x ctx slots), later from what its last load took.
"""

import dataclasses
import math
import os

from krafla_twisted.cli import options

SETTINGS = ("chat", "ctx", "parallel", "kv", "threads", "pooling")
KEYS = {"name", "file", "tokenizer", "aliases", "embeddings", *SETTINGS}
LOAD_OVERHEAD_BYTES = 16 * 2**20   # the tokenizer, the scratch buffers: beside the weights and the KV cache


class ModelsFileError(ValueError):
    """A models file or folder that cannot be served; the message names the file and the entry."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str
    tokenizer: str
    aliases: tuple = ()
    embeddings: bool = False
    settings: dict = dataclasses.field(default_factory=dict)   # option name -> value, over the command line's
    estimate: int = 0   # resident bytes its first load is expected to take
    header: dict = dataclasses.field(default_factory=dict)  # file_header(path): what its header says, for listings

    def config(self, base):
        """The option mapping that loads this model: `base` (the server's options) with this model's over
        them. A .gguf is converted first (once: see converted_files). This runs in the loading thread."""
        mlb, tokenizer = self.path, self.tokenizer
        if self.path.endswith(".gguf"):
            mlb, converted_mlt = converted_files(self.path)
            tokenizer = tokenizer or converted_mlt
        out = dict(base)
        out.update(model=mlb, tokenizer=tokenizer, embeddings=self.embeddings, alias=self.name)
        out.update(self.settings)
        return out


def read_models_file(path, base):
    """The ModelSpecs of a models file; `base` is the server's option mapping (for the defaults)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ModelsFileError(f"--models {path}: {e.strerror}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ModelsFileError(f"--models {path}: a YAML file needs PyYAML (pip install pyyaml); "
                                  "or write it as TOML") from None
        try:
            document = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ModelsFileError(f"--models {path}: not YAML: {e}") from None
    else:
        import tomllib

        try:
            document = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ModelsFileError(f"--models {path}: not TOML: {e}") from None
    items = document.get("models") if isinstance(document, dict) else document
    if not isinstance(items, list) or not items:
        raise ModelsFileError(f"--models {path}: give a non-empty list `models` ([[models]] tables in TOML)")
    folder = os.path.dirname(os.path.abspath(path))
    specs = [_spec(item, index, folder, base, path) for index, item in enumerate(items)]
    return _checked(specs, path)


def read_models_dir(folder, base):
    """A ModelSpec for every .mlb in `folder` (sorted by name), each with its .mlt beside it."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        raise ModelsFileError(f"--models-dir {folder}: {e.strerror}") from None
    specs = []
    for file_name in names:
        if not file_name.endswith((".mlb", ".gguf")):
            continue
        item = {"name": os.path.splitext(file_name)[0], "file": file_name}
        header = read_header(os.path.join(folder, file_name))   # once: for the kind here, the estimate in _spec
        if is_encoder(header):
            item["embeddings"] = True
        specs.append(_spec(item, len(specs), os.path.abspath(folder), base, folder, header))
    if not specs:
        raise ModelsFileError(f"--models-dir {folder}: no .mlb or .gguf file there")
    return _checked(specs, folder)


def _spec(item, index, folder, base, where, header=False):
    """The ModelSpec of one [[model]] table; `header` is the file's read_header when the caller read
    it already (False: not read yet)."""
    label = f"{where}: model {index + 1}"
    if not isinstance(item, dict):
        raise ModelsFileError(f"{label} is not a table of name, file, ...")
    unknown = sorted(set(item) - KEYS)
    if unknown:
        raise ModelsFileError(f"{label}: unknown key {unknown[0]!r} (known: {', '.join(sorted(KEYS))})")
    name, file_name = item.get("name"), item.get("file")
    if not isinstance(name, str) or not name.strip():
        raise ModelsFileError(f"{label}: `name` must be a non-empty string")
    label = f"{where}: model {name!r}"
    if not isinstance(file_name, str) or not file_name:
        raise ModelsFileError(f"{label}: `file` must name its .mlb")
    path = os.path.join(folder, os.path.expanduser(file_name))
    if not os.path.isfile(path):
        raise ModelsFileError(f"{label}: the file {path} does not exist")
    if not path.endswith((".mlb", ".gguf")):
        raise ModelsFileError(f"{label}: `file` must be a .mlb or a .gguf, not {file_name}")
    tokenizer = item.get("tokenizer")
    if tokenizer:
        tokenizer = os.path.join(folder, tokenizer)
    elif path.endswith(".mlb"):
        tokenizer = os.path.splitext(path)[0] + ".mlt"
    if tokenizer is not None and not os.path.isfile(tokenizer):
        raise ModelsFileError(f"{label}: its tokenizer {tokenizer} does not exist; give `tokenizer`")
    aliases = item.get("aliases", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ModelsFileError(f"{label}: `aliases` must be a list of names")
    embeddings = item.get("embeddings", False)
    if not isinstance(embeddings, bool):
        raise ModelsFileError(f"{label}: `embeddings` must be true or false")
    settings = {key: item[key] for key in SETTINGS if key in item}
    embeddings = embeddings or settings.get("pooling") == "rank"
    if "pooling" in settings and not embeddings:
        raise ModelsFileError(f"{label}: `pooling` goes with `embeddings = true`")
    if settings.get("pooling") not in (None, "mean", "cls", "last", "rank"):
        raise ModelsFileError(f"{label}: `pooling` must be mean, cls, last or rank")
    parallel = settings.get("parallel", base.get("parallel", 1))
    if not isinstance(parallel, int) or isinstance(parallel, bool) or not 1 <= parallel <= 256:
        raise ModelsFileError(f"{label}: `parallel` must be a whole number 1 to 256")
    merged = options.values({**dict(base), **{k: v for k, v in settings.items() if k != "parallel"}})
    try:
        options.validate(merged)
    except ValueError as e:
        raise ModelsFileError(f"{label}: {e}") from None
    if header is False:
        header = read_header(path)  # once, for the estimate and the listings
    estimate = memory_estimate(path, header, 0 if embeddings else parallel, merged["ctx"], merged["kv"])
    return ModelSpec(name=name, path=path, tokenizer=tokenizer, aliases=tuple(aliases), embeddings=embeddings,
                     settings=settings, estimate=estimate, header=_listing(header))


def converted_files(gguf_path):
    """The (.mlb, .mlt) a .gguf of --models is served from: converted with its own types on its first
    load into $KRAFLA_HOME/converted/NAME-ID/ (ID: a hash of the file's path, size and modification
    time, so a changed file is converted again), and reused from there on."""
    import hashlib

    from krafla_twisted.cli.models import krafla_home
    from krafla_twisted.convert.gguf import convert_gguf

    stat = os.stat(gguf_path)
    identity = f"{os.path.abspath(gguf_path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode("utf-8", "replace")
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    folder = krafla_home() / "converted" / f"{stem}-{hashlib.sha256(identity).hexdigest()[:16]}"
    mlb, mlt = folder / f"{stem}.mlb", folder / f"{stem}.mlt"
    if not (mlb.is_file() and mlt.is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path, mlb, mlt, None, progress=False)  # each written atomically
    return str(mlb), str(mlt)


def is_encoder(header):
    """Whether a model file, by its read_header, is an embedding model (a BERT-family encoder, which
    `krafla convert` writes with its pooling); False for a header that could not be read."""
    meta = header[0] if header is not None else {}
    return "pooling" in meta or str(meta.get("arch", "")).endswith("bert")


def read_header(path):
    """(metadata, tensors) of a .mlb's header (engine/container.ContainerFile's), or None for a .gguf
    (read when it is converted, at its first load) and for a header that cannot be read (the load
    refuses the file then, with the loader's error)."""
    from krafla_twisted.engine.container import ContainerFile

    if path.endswith(".gguf"):
        return None
    try:
        with ContainerFile(path) as container:
            return container.metadata, container.tensors
    except Exception:  # noqa: BLE001 - a damaged file is refused when it loads, with the loader's error
        return None


def file_header(path):
    """What a model file's header says of it, for Ollama's listings of models not loaded yet: `arch`,
    `n_params` (the elements of its tensors, as the loader counts them) and `file_type` (docs/formats.md;
    for a file converted before krafla recorded it, the type of blk.0.attn_q.weight). Empty for a .gguf
    and for a header that cannot be read (read_header)."""
    return _listing(read_header(path))


def _listing(header):
    if header is None:
        return {}
    meta, tensors = header
    first = next((type_name for name, type_name, _, _ in tensors if name == "blk.0.attn_q.weight"), "")
    return {"arch": str(meta.get("arch", "")), "n_params": sum(math.prod(shape) for _, _, shape, _ in tensors),
            "file_type": str(meta.get("file_type") or first).upper()}


def memory_estimate(path, header, parallel, ctx, kv):
    """The resident bytes loading the model at `path` (its read_header: `header`) may take at its peak:
    twice its file (repacking copies the weights out of the mapped file before the mapping goes), its
    KV cache of `parallel` slots of `ctx` positions (0: the model's own, at most 4096) and a little
    more. A file whose header cannot be read is counted as its size only: its load fails and says why."""
    import types

    from krafla_twisted.generation import generate

    size = os.path.getsize(path)
    kv_bytes = 0
    if path.endswith(".gguf"):  # its KV cache is known once converted; until then, the file and a margin
        return 2 * size + LOAD_OVERHEAD_BYTES
    if parallel:
        if header is None:
            return size
        meta = header[0]
        try:
            dims = types.SimpleNamespace(n_layers=meta["n_layers"], n_kv_heads=meta["n_kv_heads"],
                                         head_dim=meta["head_dim"])
            n_ctx = ctx or min(meta.get("max_seq", 4096), 4096)
            kv_bytes = parallel * generate.kv_cache_bytes(dims, n_ctx, kv)
        except Exception:  # noqa: BLE001 - a damaged file is refused when it loads, with the loader's error
            return size
    return 2 * size + kv_bytes + LOAD_OVERHEAD_BYTES


def _checked(specs, where):
    seen = {}
    for spec in specs:
        for name in (spec.name, *spec.aliases):
            if name in seen:
                raise ModelsFileError(f"{where}: the name {name!r} is given to both {seen[name]!r} and {spec.name!r}")
            seen[name] = spec.name
    return specs
