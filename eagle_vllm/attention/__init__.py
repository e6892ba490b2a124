"""Attention over a paged KV cache with per-request tree masks."""
