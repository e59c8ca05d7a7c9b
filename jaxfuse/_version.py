"""The package version (one place: the package, the tuning cache key and the
benchmark read it; pyproject.toml states it for the build)."""

__version__ = "0.2.0"
