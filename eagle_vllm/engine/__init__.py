"""The only package that touches vLLM internals (written against vLLM 0.32)."""
