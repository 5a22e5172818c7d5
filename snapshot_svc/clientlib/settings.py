"""Configuration from flags and environment variables, for both services and the
deploy entry point: every long flag `--some-flag` of a parser can also be set with
the variable `<PREFIX>SOME_FLAG`; a flag on the command line beats its variable,
which beats the default."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

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
