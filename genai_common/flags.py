"""Command-line flags generated from config dataclasses (docs/design.md, "Configuration").

A config field that a flag sets says so where it is declared:
``max_queue: int = flag(256, help="waiting requests before RESOURCE_EXHAUSTED")``.
The flag's name is the field's (``--max-queue``, with a prefix for a nested
config: ``--kvstore-timeout-s``), its type the field's (``int``, ``float``,
``str``, a ``bool`` is a switch; ``X | None`` is ``X``), its default the
field's default; older spellings stay as ``aliases``. ``add_flags`` declares
the flags of a dataclass on a parser or group; ``flag_values`` reads them back
as that dataclass's keyword arguments. Both servers' parsers are built this
way, and the flag groups both have (TLS, logging) are declared once here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass
from typing import Any

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}
LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_bytes(text: str) -> int:
    """Parse a byte count such as "1073741824", "512MiB", "2G" or "1.5GiB"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 1073741824, 512MiB)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line."""

    help: str | None
    name: str = ""  # without "--"; default: the (prefixed) field name, "-" for "_"
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # default: the field's type


def flag(
    default: Any = MISSING,
    *,
    help: str | None,  # noqa: A002 (argparse's own word)
    name: str = "",
    aliases: Sequence[str] = (),
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    default_factory: Any = MISSING,
    repr: bool = True,  # noqa: A002 (dataclasses' own word)
) -> Any:
    """A dataclass field with a flag (the arguments as ``Flag``'s)."""
    spec = Flag(help, name, tuple(aliases), metavar, tuple(choices) if choices else None, parse)
    if default_factory is not MISSING:
        return dataclasses.field(
            default_factory=default_factory, repr=repr, metadata={"flag": spec}
        )
    return dataclasses.field(default=default, repr=repr, metadata={"flag": spec})


def flag_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of dataclass ``cls`` that have a flag, with their ``Flag``."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def option(f: dataclasses.Field[Any], spec: Flag, prefix: str = "") -> str:
    """The flag's main spelling, e.g. ``--kvstore-timeout-s``."""
    return "--" + (spec.name or (prefix + f.name).replace("_", "-"))


def dest(f: dataclasses.Field[Any], spec: Flag, prefix: str = "") -> str:
    return option(f, spec, prefix)[2:].replace("-", "_")


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"{f.name}: a flag needs a default")


def value_type(annotation: Any) -> type:
    """``int`` of ``int``, ``int | None`` and ``Optional[int]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return value_type(args[0])
    if not isinstance(annotation, type):
        raise TypeError(f"no flag type for {annotation!r}")
    return annotation


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    prefix: str = "",
    *,
    only: Sequence[str] | None = None,
) -> None:
    """Declare the flags of dataclass ``cls`` (or of its fields in ``only``)."""
    hints = typing.get_type_hints(cls)
    for f, spec in flag_fields(cls):
        if only is not None and f.name not in only:
            continue
        kind = value_type(hints[f.name])
        kw: dict[str, Any] = {
            "dest": dest(f, spec, prefix),
            "default": default_of(f),
            "help": spec.help,
        }
        if kind is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = spec.parse or kind
            kw["metavar"] = spec.metavar
            if spec.choices:
                kw["choices"] = spec.choices
        parser.add_argument(option(f, spec, prefix), *spec.aliases, **kw)


def flag_values(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The keyword arguments of ``cls`` that its flags in ``args`` give."""
    return {f.name: getattr(args, dest(f, spec, prefix)) for f, spec in flag_fields(cls)}


# -- the groups both servers have ----------------------------------------------------


def tls_server_fields(client_ca_help: str) -> dict[str, Any]:
    """The TLS fields of a server's config: ``tls_cert_file``, ``tls_key_file``,
    ``tls_client_ca_file`` (PEM paths; None: plain text). Use as
    ``tls_cert_file: str | None = TLS["tls_cert_file"]``."""
    return {
        "tls_cert_file": flag(
            None, help="serve TLS (with --tls-key-file)", aliases=["--tls-cert"], metavar="PEM"
        ),
        "tls_key_file": flag(None, help=None, aliases=["--tls-key"], metavar="PEM"),
        "tls_client_ca_file": flag(
            None, help=client_ca_help, aliases=["--tls-client-ca"], metavar="PEM"
        ),
    }


TLS_FIELDS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")


def add_logging_flags(
    parser: argparse.ArgumentParser, default_format: str, *, level: bool = False
) -> None:
    """``--log-format`` (and, with ``level``, ``--log-level``)."""
    parser.add_argument(
        "--log-format", choices=LOG_FORMATS, default=default_format, help="log lines as"
    )
    if level:
        parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="least level")


def add_auth_token_file(
    group: argparse._ArgumentGroup | argparse.ArgumentParser, help: str
) -> None:  # noqa: A002
    """``--auth-token-file PATH``: the bearer token(s) the server requires."""
    group.add_argument("--auth-token-file", default=None, metavar="PATH", help=help)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help, except where there is no default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.help is None:
            return action.help
        return super()._get_help_string(action)
