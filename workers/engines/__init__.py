"""Generator and Trainer protocols, native torch engines, and lazily imported adapters."""
