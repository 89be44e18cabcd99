"""`python -m sglang_ext COMMAND ...` -- commands: inspect-draft."""

import sys

COMMANDS = {"inspect-draft": "sglang_ext.inspect_draft"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m sglang_ext {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
