"""The ``shoal`` command: ``serve``, ``runtime build``, ``check``.

Flags are generated from :class:`shoal.config.Settings`, so every setting is a
flag (``--pool-size``) and an environment variable (``SHOAL_POOL_SIZE``) with
one description, and a flag given on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import sys
import typing

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
        kind = annotation if annotation in (int, float) else str
        if typing.get_origin(annotation) is not None:
            kind = str
        parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text)


def settings_from(args: argparse.Namespace) -> Settings:
    given = {name: value for name, value in vars(args).items()
             if name in Settings.model_fields and value is not None}
    return Settings(**given)


def _serve(args: argparse.Namespace) -> int:
    from .server import serve

    return serve(settings_from(args))


def _runtime_build(args: argparse.Namespace) -> int:
    from .sandbox.runtime import build_runtime

    build_runtime(settings_from(args).runtime_dir)
    return 0


def _check(args: argparse.Namespace) -> int:
    from .server import startup_problems

    from .sandbox.preflight import zygote_problems

    settings = settings_from(args)
    found = startup_problems(settings)
    if found:
        print("Shoal cannot run here:\n  - " + "\n  - ".join(found), file=sys.stderr)
        return 1
    print("isolation: bubblewrap, seccomp, cgroups and the runtime are all available")
    if settings.launcher == "bwrap":
        print("launcher: bwrap (chosen by the setting)")
        return 0
    slow = zygote_problems()
    if slow:
        print("launcher: bwrap, because the zygote cannot run here:\n  - " + "\n  - ".join(slow))
    else:
        print("launcher: zygote (forked sandboxes, each in its own user namespace)")
    return 0


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

    check = commands.add_parser("check", help="say whether this host can isolate sandboxes")
    _add_setting_flags(check)
    check.set_defaults(handler=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
