"""`freetoken` / `ft` command line."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from freetoken import __version__

COMMANDS = {
    "serve": "Serve a model over the OpenAI API (`freetoken serve --help` lists its options).",
}

USAGE = "usage: freetoken [-h] [-V] <command> [options]"


def version() -> str:
    """The installed distribution's version, else the source tree's `freetoken.__version__`."""
    try:
        return dist_version("freetoken")
    except PackageNotFoundError:
        return __version__


def _help() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = [USAGE, "", "FreeToken: a compact OpenAI-compatible LLM server with its own engine.",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help     show this help and exit",
              "  -V, --version  print the version and exit"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(_help(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(_help())
        return 0
    if command in ("-V", "--version"):
        print(f"freetoken {version()}")
        return 0
    if command == "serve":
        # The server's imports (fastapi, the parsers) only for `serve`: --version stays instant.
        from freetoken.serving.launch.serve import launch_server

        return launch_server(rest, prog="freetoken serve")
    print(f"{USAGE}\nfreetoken: unknown command {command!r} (choose from: {', '.join(COMMANDS)})",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
