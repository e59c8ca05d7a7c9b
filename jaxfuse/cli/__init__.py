"""Command lines: `python -m jaxfuse.cli.explain` (also the `jaxfuse-explain` script)."""
