"""The command line: every `krafla` subcommand, and the options `twistd krafla` shares with them.

main dispatches `krafla run | convert | pull | info | bench | perplexity` to run, convert, models,
info, bench and perplexity; options is the one table of model, chat, engine and sampling options;
startup turns those options into a loaded generation Runtime, pulling the default model if needed;
registry reads the models file of `twistd krafla --models` (or --models-dir) into ModelSpecs.
It may import every layer below it (engine, chat, generation, convert) and never api/.
"""
