"""`radixlm serve`'s command line, generated from the settings' fields: one flag per setting,
grouped by section, with its help, default, type, choices and range; nothing is defined only
here. A bad value is one argparse-style line, before anything loads."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable

from .server_args import SECTIONS, ServerArgs
from .setting_fields import Section, kind_of


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parser_of(section: type[Section], f: dataclasses.Field) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return section.parse(f, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = f.name  # argparse names the type in some messages
    return parse


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for name, section in SECTIONS.items():
        group = parser.add_argument_group(name, (section.__doc__ or "").split("\n")[0])
        for f in dataclasses.fields(section):
            meta = f.metadata
            help_text = meta["help"] + (f"; unset: ${meta['env']} if set" if meta["env"] else "")
            if kind_of(f) is bool:
                group.add_argument(_flag(f.name), action="store_true", default=f.default, help=help_text)
            elif kind_of(f) is tuple:  # several values: --lora-paths a=dir1 b=dir2
                group.add_argument(_flag(f.name), nargs="+", default=f.default, help=help_text,
                                   metavar=f.name.split("_")[-1].upper())
            else:
                group.add_argument(_flag(f.name), type=_parser_of(section, f), default=f.default, help=help_text,
                                   metavar=f.name.split("_")[-1].upper())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlm serve", usage="radixlm serve [--model-path PATH] [--port N] [...]",
                                     description="Serve a model over HTTP (SGLang's native API and OpenAI's /v1 "
                                                 "routes). Every flag is a setting, grouped by the component that "
                                                 "reads it.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_setting_flags(parser)
    return parser


def parse_flags(argv: list[str]) -> ServerArgs:
    """The settings `argv` gives; exits with argparse's usage line and one error for a bad one.
    A setting with an environment alias not given on the command line is read from it (a key
    given on the command line shows in `ps`; the environment keeps it private)."""
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    for section in SECTIONS.values():
        for f in dataclasses.fields(section):
            env = f.metadata["env"]
            if env and values[f.name] is None and os.environ.get(env):
                values[f.name] = os.environ[env]
    try:
        return ServerArgs(**values)
    except ValueError as e:
        parser.error(str(e))


def to_flags(values: dict[str, Any]) -> list[str]:
    """Command-line flags that give these settings (by flat name)."""
    argv: list[str] = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv += [_flag(name)] if value else []
        elif isinstance(value, (list, tuple)):
            argv += [_flag(name), *map(str, value)] if value else []
        elif value is not None:
            argv += [_flag(name), str(value)]
    return argv
