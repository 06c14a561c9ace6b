"""Models on disk: fetching and caching them, their tokenizer, and what a job writes back.

- ``store``: ``fp8rl model fetch``, the cache, and resolving a spec's model to a directory;
- ``gguf_file``: reading a GGUF checkpoint; ``tokenizer``: the chat template and stop ids;
- ``hf_export``: a trained model as a Hugging Face directory; ``checkpoint``: a job's resumable state.
"""
