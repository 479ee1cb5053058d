"""The `metrale` command (`python -m metrale`, and the console script): the CLI imported inside
the Ctrl-C handling, so that an interrupt while torch loads (a few seconds) exits with 130 and
no traceback, as one during a run does (`cli.main`)."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from metrale.cli import main as cli_main
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
