"""Attention backends over the paged KV pool."""
