"""`freetoken` / `ft` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: freetoken serve [MODEL] [options]   (freetoken serve --help for the options)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from freetoken.server.launch import launch_server

        return launch_server(rest, prog="freetoken serve")
    print(f"freetoken: unknown command {command!r} (try: freetoken serve)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
