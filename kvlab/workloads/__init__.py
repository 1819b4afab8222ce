"""Seeded request traces and the PagedAttention paper's memory-waste simulator (kvlab's own)."""
