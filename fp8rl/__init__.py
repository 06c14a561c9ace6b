"""fp8rl: end-to-end FP8 reinforcement-learning post-training of LLMs, as a Kubernetes service.

This package holds the ``fp8rl`` command line only; the system lives in rljob/, workers/,
service/ and operators/ (docs/architecture.md).
"""

from rljob.version import __version__

__all__ = ["__version__"]
