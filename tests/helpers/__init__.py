"""Test helpers: the synthetic checkpoint and the catalog of crafted bad inputs (no vLLM engine)."""
