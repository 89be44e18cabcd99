"""`python -m sglang_ext COMMAND ...` -- commands: inspect-draft."""

import sys

COMMANDS = {"inspect-draft": ("sglang_ext.inspect_draft", "check an Eagle3 head against its target before serving")}


def usage() -> str:
    lines = ["usage: python -m sglang_ext COMMAND [options]   (COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<14} {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] == "--version":
        from sglang_ext import __version__

        print(f"sglang-eagle3-mla {__version__}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
