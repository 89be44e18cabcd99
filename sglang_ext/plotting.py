"""matplotlib for the reports' figures, optional: without it a command writes its JSON and markdown reports and says
which extra installs the figures, instead of ending in a traceback after the work is done."""

from __future__ import annotations

import sys


def pyplot(extra: str, what: str):
    """`matplotlib.pyplot` on the Agg backend, or None after a note on stderr naming `what` was skipped and the
    package extra (`train`, `eval`) that installs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: {what} not written: matplotlib is not installed (pip install 'sglang-eagle3-mla[{extra}]')",
              file=sys.stderr)
        return None
    return plt
