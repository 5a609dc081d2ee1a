"""The ``shoal`` command: ``serve``, ``runtime build``, ``check``.

Flags are generated from :class:`shoal.config.Settings`, so every setting is a
flag (``--pool-size``) and an environment variable (``SHOAL_POOL_SIZE``) with
one description, and a flag given on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pydantic

from .config import Settings


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = "SHOAL_" + name.upper()
        help_text = f"{field.description} [env {env}; default {field.default}]"
        annotation = field.annotation
        if annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
            continue
        # Every value is read as text and checked by Settings, so a bad number is the
        # same one-line error as any other bad setting (not argparse's usage dump).
        parser.add_argument(flag, dest=name, default=None, help=help_text)


class BadSetting(ValueError):
    """A setting (flag or variable) that cannot be used; one line names it."""


def settings_from(args: argparse.Namespace) -> Settings:
    given = {name: value for name, value in vars(args).items()
             if name in Settings.model_fields and value is not None}
    try:
        return Settings(**given)
    except pydantic.ValidationError as exc:
        problems = []
        for error in exc.errors():
            if not error.get("loc"):
                # A check of several settings together: its message names them.
                problems.append(_plain(error))
                continue
            name = str(error["loc"][0])
            source = (f"--{name.replace('_', '-')}" if name in given
                      else f"SHOAL_{name.upper()}")
            shown = "(not shown)" if name in _SECRET_SETTINGS else f"{error.get('input')!s}"
            problems.append(f"{source}={shown}: {_plain(error)}")
        raise BadSetting("; ".join(problems)) from None


# Settings whose value may hold a password or key: an error never echoes them.
_SECRET_SETTINGS = {"database_url", "tokens", "operator_tokens", "upstream_anthropic_key",
                    "upstream_openai_key", "object_store_access_key", "object_store_secret_key"}


def _plain(error: dict) -> str:
    """pydantic's message, with the allowed values spelt out where it has them."""
    if error.get("type") == "string_pattern_mismatch":
        pattern = str(error.get("ctx", {}).get("pattern", ""))
        choices = pattern.strip("^$()").split("|")
        return "must be one of " + ", ".join(choices)
    message = str(error.get("msg", "invalid"))
    return message.removeprefix("Value error, ") if error.get("type") == "value_error" \
        else message.lower()


def _serve(args: argparse.Namespace) -> int:
    from .server import serve

    return serve(settings_from(args))


def _runtime_build(args: argparse.Namespace) -> int:
    from .sandbox.runtime import build_runtime

    build_runtime(settings_from(args).runtime_dir)
    return 0


def _runtime_page(args: argparse.Namespace) -> int:
    from .sandbox.catalog import page
    from .sandbox.runtime import python_version

    sys.stdout.write(page(python_version()))
    return 0


def _check(args: argparse.Namespace) -> int:
    from .server import startup_problems

    from .sandbox.cgroups import dynamic_changes_favored
    from .sandbox.preflight import zygote_problems

    settings = settings_from(args)
    found = startup_problems(settings)
    if found:
        print("Shoal cannot run here:\n  - " + "\n  - ".join(found), file=sys.stderr)
        return 1
    print("isolation: bubblewrap, seccomp, cgroups and the runtime are all available")
    print(_open_files_line(settings))
    print(_connections_line(settings))
    if settings.launcher == "bwrap":
        print("launcher: bwrap (chosen by the setting)")
        return 0
    slow = zygote_problems()
    if slow:
        print("launcher: bwrap, because the zygote cannot run here:\n  - " + "\n  - ".join(slow))
    else:
        print("launcher: zygote (forked sandboxes, each in its own user namespace)")
    if dynamic_changes_favored():
        print("cgroups: favordynmods is set (a sandbox joins its cgroups in well under a ms)")
    elif settings.cgroup_favor_dynmods:
        print("cgroups: favordynmods is not set yet; serve sets it at start")
    else:
        print("cgroups: favordynmods is not set: each sandbox's cgroup join waits for an RCU "
              "grace period (--cgroup-favor-dynmods sets it)")
    return 0


def _open_files_line(settings) -> str:
    """Whether the host's open-file table outlasts every sandbox's share of it: the
    table is host-wide (fs.file-max) and what a sandbox may hold (its processes
    times their RLIMIT_NOFILE) is bounded by its memory, not by the table."""
    from .sandbox.launcher import LaunchConfig

    per_sandbox = settings.pids_limit * LaunchConfig.max_open_files
    try:
        table = int(Path("/proc/sys/fs/file-max").read_text())
    except (OSError, ValueError):
        return "open files: fs.file-max is unreadable here"
    wanted = per_sandbox * settings.max_sessions
    if table >= wanted:
        return f"open files: fs.file-max {table} holds every sandbox's {per_sandbox} at once"
    return (f"open files: fs.file-max {table} is less than {settings.max_sessions} sandboxes "
            f"may hold ({per_sandbox} each): a few could leave the host none; raise it "
            f"(sysctl -w fs.file-max={wanted}: open files are charged to each sandbox's memory)")


def _connections_line(settings) -> str:
    """Whether the open-file limit serve would raise itself to (this shell's hard
    limit; a service's is its unit's LimitNOFILE) holds max_connections."""
    import resource

    from .server import open_files_shortfall

    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    shortfall = open_files_shortfall(settings, limit)
    if shortfall:
        return f"connections: {shortfall}"
    return (f"connections: the open-file limit {limit} holds max_connections "
            f"({settings.max_connections}) and the sandboxes' share")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the HTTP API",
                                description="Serve the code-execution protocol and the "
                                            "gateway dialects over HTTP.")
    _add_setting_flags(serve)
    serve.set_defaults(handler=_serve)

    runtime = commands.add_parser("runtime", help="manage the sandbox runtime environment")
    runtime_commands = runtime.add_subparsers(dest="runtime_command", required=True)
    build = runtime_commands.add_parser("build", help="build the pinned runtime if missing")
    _add_setting_flags(build)
    build.set_defaults(handler=_runtime_build)
    page = runtime_commands.add_parser("page", help="print docs/runtime.md: the libraries "
                                                    "and commands sandboxes offer")
    page.set_defaults(handler=_runtime_page)

    check = commands.add_parser("check", help="say whether this host can isolate sandboxes")
    _add_setting_flags(check)
    check.set_defaults(handler=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except BadSetting as exc:
        print(f"shoal: invalid setting: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
