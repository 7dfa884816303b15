"""DeepSpeed's launch conventions: the command-line arguments its scripts parse, the config they point at, and the
local rank its launcher passes.

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)     # DeepSpeed's launcher passes --local_rank=N
    parser = llmpar.add_config_arguments(parser)                   # --deepspeed, --deepspeed_config
    args = parser.parse_args()
    engine, optimizer, _, _ = llmpar.initialize(args=args, model=model, model_parameters=model.parameters())

``torchrun --nproc_per_node N train.py --deepspeed --deepspeed_config ds.json`` runs such a script as is (torchrun
sets ``LOCAL_RANK``; DeepSpeed's launcher sets it too and also passes ``--local_rank``). After ``initialize``,
``args.local_rank`` holds the local rank, as DeepSpeed leaves it.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from llmpar.distributed.discovery import adopt_local_rank

logger = logging.getLogger("llmpar")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to ``parser`` and return it: ``--deepspeed`` (a flag for the script's own use),
    ``--deepspeed_config PATH`` (read by ``initialize(args=args)``) and the deprecated ``--deepscale`` /
    ``--deepscale_config``."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"parser must be an argparse.ArgumentParser, got {type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on the engine)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the engine)",
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file."
    )
    return parser


def config_from_args(args: Any, config: Any, config_params: Any) -> Any:
    """The config ``initialize`` reads: ``config=`` (or its old name ``config_params=``), or ``args.deepspeed_config``
    (or the deprecated ``args.deepscale_config``); exactly one of them."""
    if config is not None and config_params is not None:
        raise ValueError("give config= or its old name config_params=, not both")
    config = config if config is not None else config_params
    if args is not None:
        given = getattr(args, "deepspeed_config", None)
        legacy = getattr(args, "deepscale_config", None)
        if legacy is not None:
            if given is not None:
                raise ValueError(
                    f"args has both deepspeed_config={given!r} and the deprecated deepscale_config="
                    f"{legacy!r}: give --deepspeed_config only"
                )
            logger.warning("--deepscale_config is deprecated, use --deepspeed_config")
            given = legacy
        if given is not None:
            if config is not None:
                raise ValueError(
                    f"the DeepSpeed config is given twice: args.deepspeed_config={given!r} and config=; "
                    "give one of them"
                )
            config = given
    if config is None:
        raise ValueError(
            "llmpar.initialize needs a DeepSpeed config: config= (a dict or the path of a JSON file), or "
            "args= with --deepspeed_config PATH (llmpar.add_config_arguments(parser) adds the flag)"
        )
    return config


def take_local_rank(args: Any) -> None:
    """DeepSpeed's ``--local_rank`` convention, before the process group starts: a non-negative ``args.local_rank``
    must equal ``LOCAL_RANK`` when the launcher set it, and stands in for it when it did not."""
    value = getattr(args, "local_rank", None) if args is not None else None
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"args.local_rank must be an int, got {type(value).__name__} {value!r}")
    adopt_local_rank(value)  # the launcher's LOCAL_RANK (llmpar.distributed.discovery)


def give_local_rank(args: Any, local_rank: int) -> None:
    """Leave the local rank in ``args.local_rank`` (when ``args`` has that attribute), as DeepSpeed does."""
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local_rank


__all__ = ["add_config_arguments", "config_from_args", "give_local_rank", "take_local_rank"]
