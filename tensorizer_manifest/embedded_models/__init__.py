"""Tiny models this package builds itself (no hub, no network): the demo's default and the family matrix.

``tiny`` writes a small Hugging Face model directory for any of ``families``' kinds. Used by the demo, by
``verify-kernels`` and by the tests; of the package it imports only ``_vllm_compat`` (its CPU probe).
"""
