"""`krafla convert SRC.gguf|HF_FOLDER [-o OUT.mlb] [-z OUT.mlt] [--type q4_0]`.

A GGUF file keeps its tensors' types unless --type asks for another (its blocks are copied as
they are); a Hugging Face folder is quantized to --type (default q4_0)."""

import sys
from pathlib import Path

from krafla_twisted.convert.gguf import OUTPUT_TYPES, ConvertError, convert_gguf, output_names
from krafla_twisted.convert.bert import convert_bert, convert_bert_gguf, is_bert, is_bert_gguf
from krafla_twisted.convert.hf import convert_hf
from krafla_twisted.engine.formats import FormatError


def add_arguments(parser):
    parser.add_argument("source", metavar="SRC", help="a GGUF file, or a Hugging Face folder (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("-o", "--output", metavar="OUT.mlb",
                        help="model file to write (default: NAME-TYPE.mlb beside SRC, e.g. SmolLM2-135M-Instruct-Q4_1.mlb "
                             "for a GGUF's own types, -Q4_0.mlb with --type q4_0)")
    parser.add_argument("-z", "--tokenizer", metavar="OUT.mlt",
                        help="tokenizer file to write (default: the model file's name with .mlt)")
    parser.add_argument("--type", dest="type_name", choices=OUTPUT_TYPES, default=None,
                        help="requantize the matrices to this type (q4_0: its output head q8_0). Default: a GGUF "
                             "keeps each tensor's type, its blocks copied as they are; a Hugging Face folder q4_0")
    parser.add_argument("--name", help="model name stored in the file (default: from the output name)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def main(args):
    source = Path(args.source)
    encoder = source.is_dir() and is_bert(source)  # an embedding model: convert/bert.py, f16 by default
    encoder_gguf = source.is_file() and source.suffix == ".gguf" and is_bert_gguf(source)
    if source.is_dir():
        args.type_name = args.type_name or ("f16" if encoder else "q4_0")
        default_mlb = source.parent / f"{source.name}-{args.type_name.upper()}.mlb"
    else:
        default_mlb, _ = output_names(source, args.type_name)
    out_mlb = Path(args.output) if args.output else default_mlb
    out_mlt = Path(args.tokenizer) if args.tokenizer else out_mlb.with_suffix(".mlt")
    try:
        if encoder or encoder_gguf:
            convert = convert_bert if encoder else convert_bert_gguf
            convert(source, out_mlb, out_mlt, args.type_name, progress=not args.quiet, name=args.name)
            print(f"wrote {out_mlb} and {out_mlt} (an encoder: serve it with twistd krafla --embeddings)")
            return 0
        if source.is_dir():
            convert_hf(source, out_mlb, out_mlt, args.type_name, progress=not args.quiet, name=args.name)
        else:
            convert_gguf(source, out_mlb, out_mlt, args.type_name, progress=not args.quiet, name=args.name)
    except (ConvertError, FormatError, OSError) as e:
        print(f"krafla convert: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out_mlb} and {out_mlt}")
    print(_template_line(out_mlt))
    return 0


def _template_line(mlt):
    """What the .mlt says about the chat template: its name and how it was found, or the hint."""
    from krafla_twisted.chat import templates
    from krafla_twisted.engine import formats

    metadata = formats.read(mlt, magic=formats.TOKENIZER_MAGIC).metadata
    name = metadata.get("chat_template")
    if name is None:
        where = "is none of krafla's" if "chat_template_jinja" in metadata else "is not in the source"
        return (f"chat template: the model's own template {where}; serve it with --chat NAME "
                f"({', '.join(templates.TEMPLATE_NAMES)})")
    how = {"jinja": "renders like the model's own template",
           "vocabulary": "the source has no template; its vocabulary's turn markers are this format's"}
    return f"chat template: {name} ({how.get(metadata.get('chat_template_from'), 'from the tokenizer file')})"
