"""Pure-torch Eagle3 core: heads, aux capture, drafting, verification, accounting, reference decoder.

Imports no SGLang. Submodules import torch; this package file does not.
"""
