"""The native torch engines: generator and trainer, CPU and GPU (the default)."""
