"""FastAPI control plane: routes, auth, settings, job stores and the local executor."""
