"""``vlmd serve`` flags, generated from the settings in ``vlmd/config.py:ServeConfig``.

A setting is defined once (its field: name, type, default, help); this module turns every
field into a flag whose help shows the default, and the parsed flags back into a
``ServeConfig``. Nothing here names a setting, except the flags vlmd refuses on purpose.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import Field, fields

from vlmd.config import ServeConfig, setting_default

# Flags other servers take that vlmd refuses, with the reason (a vLLM user will try them).
REFUSED_FLAGS = {
    "--trust-remote-code": "vlmd never runs Python code shipped inside a checkpoint; "
    "model families are installed plugins (see docs/architecture.md, 'Model families')",
}


_METAVARS = {int: "N", float: "NUM", str: "TEXT"}
_EXPECTED = {int: "an integer", float: "a number"}


def _value_type(spec: Field) -> type:
    """The scalar type of a field annotated ``int``, ``int | None``, ``float`` or ``str``."""
    hints = typing.get_type_hints(ServeConfig)
    annotation = hints[spec.name]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return annotation if annotation in (int, float, str, bool) else str


def _shown_default(spec: Field) -> str:
    env = spec.metadata.get("env")
    value = setting_default(spec)
    if value is None or value == {} or value == ():
        shown = "unset"
    elif isinstance(value, bool):
        shown = "on" if value else "off"
    else:
        shown = str(value)
    return f"{shown}; env {env}" if env else shown


def _parser_for(parse, value_type: type, flag: str):
    """An argparse ``type`` that reports a bad value as ``FLAG: reason``."""

    def convert(text: str):
        if parse is None and value_type in _EXPECTED:
            try:
                return value_type(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {_EXPECTED[value_type]}, got {text!r}") from None
        try:
            return parse(text) if parse is not None else value_type(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc) or f"invalid value {text!r}") from None

    convert.__name__ = value_type.__name__  # argparse names the type in its message
    return convert


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for spec in fields(ServeConfig):
        if spec.metadata.get("positional"):
            parser.add_argument(spec.name, nargs="?", metavar="MODEL_DIR", help=spec.metadata["help"])
            # vLLM's `vllm serve --model DIR` habit: the same value, by flag.
            parser.add_argument("--" + spec.name, dest=spec.name + "_flag", metavar="MODEL_DIR",
                                help="the same as MODEL_DIR")
            continue
        add_setting_flag(parser, spec)
    for flag, reason in REFUSED_FLAGS.items():
        parser.add_argument(flag, dest="refused_" + flag.strip("-").replace("-", "_"), action="store_true",
                            help=f"refused: {reason}")


def add_setting_flag(parser: argparse.ArgumentParser, spec: Field) -> None:
    """The ``--flag`` of one ``ServeConfig`` setting; ``vlmd cost`` adds the serve flags it shares this way."""
    meta = spec.metadata
    flag = "--" + spec.name.replace("_", "-")
    value_type = _value_type(spec)
    help_text = meta["help"]
    if "(default:" not in help_text:
        help_text += f" (default: {_shown_default(spec)})"
    elif meta.get("env"):
        help_text = help_text[:-1] + f"; env {meta['env']})"
    if value_type is bool:
        action = argparse.BooleanOptionalAction if meta.get("negatable") else "store_true"
        parser.add_argument(flag, dest=spec.name, action=action, default=setting_default(spec), help=help_text)
        return
    default = setting_default(spec)
    if meta.get("env"):
        default = os.environ.get(meta["env"], default)
    parser.add_argument(
        flag, dest=spec.name, default=default, help=help_text,
        metavar=meta.get("metavar") or (None if meta.get("choices") else _METAVARS.get(value_type, "TEXT")),
        choices=meta.get("choices"), type=_parser_for(meta.get("parse"), value_type, flag),
    )


def refused_flag(args: argparse.Namespace) -> str | None:
    """The message for the first refused flag given, if any."""
    for flag, reason in REFUSED_FLAGS.items():
        if getattr(args, "refused_" + flag.strip("-").replace("-", "_"), False):
            return f"{flag} is not supported: {reason}"
    return None


def config_from_flags(args: argparse.Namespace, model: str) -> ServeConfig:
    values = {spec.name: getattr(args, spec.name) for spec in fields(ServeConfig) if spec.name != "model"}
    config = ServeConfig(model=model, **values)
    config.validate()
    return config
