"""`python -m sglang_ext COMMAND ...` -- the commands of sglang_ext.commands (each also a console script)."""

import sys

from sglang_ext.commands import COMMANDS, VERSION, run


def usage() -> str:
    lines = ["usage: python -m sglang_ext COMMAND [options]   (COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<14} {c.description} (also: {c.script})" for name, c in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] == "--version":
        print(VERSION)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        return 2
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
