"""SGLang 0.5.17 adapters. Each module names the upstream symbol it extends and why."""
