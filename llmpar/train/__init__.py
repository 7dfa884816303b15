"""``llmpar train``: the demo GPT trained through ``llmpar.initialize`` (see ``command.py`` for the command line,
``options.py`` for the config the flags build, ``loop.py`` for the run)."""

from llmpar.train.command import main, register
from llmpar.train.loop import MIN_DROP, ConfigError, TrainResult, format_summary, param_groups, train
from llmpar.train.options import TrainOptions, build_config, check_layout, degrees, load_config, resolve

__all__ = [
    "MIN_DROP",
    "ConfigError",
    "TrainOptions",
    "TrainResult",
    "build_config",
    "check_layout",
    "degrees",
    "format_summary",
    "load_config",
    "main",
    "param_groups",
    "register",
    "resolve",
    "train",
]
