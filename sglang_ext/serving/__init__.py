"""SGLang 0.5.17 - 0.5.23 adapters. Each module names the upstream symbol it extends and why; what differs between
those releases is looked up in compat.py."""
