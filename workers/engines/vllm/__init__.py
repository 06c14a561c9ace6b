"""The vLLM generator (vLLM 0.32): the engine, its worker extension and its weight-transfer backend."""
