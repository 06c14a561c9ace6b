"""The installed fp8rl's version, for every tier (the CLI's ``--version``, the API's OpenAPI document).

Read from the distribution's metadata (pyproject.toml's ``version``), so it is written in one place.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("fp8rl")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
