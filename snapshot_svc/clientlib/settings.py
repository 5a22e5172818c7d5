"""Configuration from flags and environment variables, for both services and the
deploy entry point: every long flag `--some-flag` of a parser can also be set with
the variable `<PREFIX>SOME_FLAG`; a flag on the command line beats its variable,
which beats the default. A flag can be declared from the field of a frozen dataclass
that holds the configuration (`field_flags`, `field_values`): its default and its parsing
come from the field."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

_OFF = ("0", "false", "no", "off")

# The inference service's snapshot-client flags would get WARMSLOT_SNAPSHOT_TLS_CA/_CERT/
# _KEY, and the last two are the snapshot service's own --tls-cert/--tls-key variables
# (its prefix is WARMSLOT_SNAPSHOT_): one environment for both services would give the
# snapshot service the client's certificate and the inference service the server's.
# These flags read CLIENT variables instead, as the snapshot CLI (snapshot_svc.ctl) does.
CLIENT_VARS = {"WARMSLOT_SNAPSHOT_TLS_CA": "WARMSLOT_SNAPSHOT_CLIENT_TLS_CA",
               "WARMSLOT_SNAPSHOT_TLS_CERT": "WARMSLOT_SNAPSHOT_CLIENT_TLS_CERT",
               "WARMSLOT_SNAPSHOT_TLS_KEY": "WARMSLOT_SNAPSHOT_CLIENT_TLS_KEY"}


def env_var(prefix: str, flag: str) -> str:
    """`--slot-save-path` -> `<prefix>SLOT_SAVE_PATH` (except CLIENT_VARS)."""
    name = prefix + flag.lstrip("-").replace("-", "_").upper()
    return CLIENT_VARS.get(name, name) if prefix == "WARMSLOT_" else name


def _long_flag(action: argparse.Action) -> str | None:
    return next((s for s in action.option_strings if s.startswith("--")), None)


def env_args(parser: argparse.ArgumentParser, env: Mapping[str, str],
             prefix: str) -> list[str]:
    """`--flag value` for every variable of the parser's flags set in `env`."""
    out: list[str] = []
    for action in parser._actions:
        flag = _long_flag(action)
        if flag is None or flag == "--help" or (var := env_var(prefix, flag)) not in env:
            continue
        value = env[var]
        if isinstance(action, argparse.BooleanOptionalAction):  # PREFIX_AUTO_SAVE=0
            off = value.strip().lower() in _OFF
            out.append("--no-" + flag[2:] if off else flag)
        elif action.nargs == 0:  # store_true
            if value.strip().lower() not in _OFF:
                out.append(flag)
        else:
            out += [flag, value]
    return out


def document_env(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Appends `[env VAR]` to every flag's help."""
    for action in parser._actions:
        flag = _long_flag(action)
        if flag is not None and flag != "--help" and action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {env_var(prefix, flag)}]".strip()


def parse(parser: argparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str],
          prefix: str, known_only: bool = False) -> argparse.Namespace:
    """The parsed flags: the environment's first, then the command line's (which win).
    `known_only`: ignore flags the parser does not define (the entry point reads a
    few settings of a service's command line)."""
    args = [*env_args(parser, env, prefix), *argv]
    if known_only:
        return parser.parse_known_args(args)[0]
    return parser.parse_args(args)


def _none_or(value: str, convert: Callable[[str], Any], none: tuple[str, ...]) -> Any:
    return None if value.strip().lower() in none else convert(value)


def str_or_none(value: str) -> str | None:
    return _none_or(value, str.strip, ("", "none"))


def path_or_none(value: str) -> Path | None:
    return _none_or(value, Path, ("", "none"))


def int_or_none(value: str) -> int | None:
    return _none_or(value, lambda v: int(v, 0), ("", "none", "auto"))


# how a flag's text becomes its field's value, by the field's annotation
PARSERS: Mapping[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "Path": Path,
    "Path | None": path_or_none, "int | None": int_or_none, "str | None": str_or_none}


def field_flags(parser: argparse.ArgumentParser, defaults: Any, group: str = "",
                prefix: str = "--") -> Callable[..., None]:
    """add(flag, help, field=None, **kw) adds the flag of a field of `defaults` (a frozen
    dataclass): `--slot-save-path` sets slot_save_path; with a group, `--spec-n-max`
    (prefix "--spec-") sets speculative.n_max. The default and the parsing come from the
    field (a bool is --x / --no-x; `type=` overrides); the dest is the field's path with
    "__" for ".", which field_values reads back."""
    def add(flag: str, help: str | None = None, field: str | None = None, **kw: Any) -> None:
        name = field or flag.removeprefix(prefix).replace("-", "_")
        path = f"{group}.{name}" if group else name
        *outer, name = path.split(".")
        owner: Any = defaults
        for part in outer:
            owner = getattr(owner, part)
        kind = {f.name: f.type for f in dataclasses.fields(owner)}[name]
        kind = kind if isinstance(kind, str) else kind.__name__
        if kind == "bool":
            kw.setdefault("action", argparse.BooleanOptionalAction)
        else:
            kw.setdefault("type", PARSERS[kind])
            if "choices" not in kw:
                kw.setdefault("metavar", flag[2:].replace("-", "_").upper())
        parser.add_argument(flag, dest=path.replace(".", "__"), default=getattr(owner, name),
                            help=help, **kw)
    return add


def field_values(ns: argparse.Namespace, defaults: Any) -> dict[str, Any]:
    """The keyword arguments of the configuration from flags added by field_flags
    (nested fields: `defaults`' value of that field with the parsed ones replaced)."""
    values: dict[str, dict[str, Any]] = {}
    for dest, value in vars(ns).items():
        outer, _, name = dest.rpartition("__")
        values.setdefault(outer, {})[name] = value
    nested = {outer: dataclasses.replace(getattr(defaults, outer), **kw)
              for outer, kw in values.items() if outer}
    return {**values.get("", {}), **nested}
