"""The manifest as data: its schema (every record, encoding, the JSON schema) and the verification records.

``schema`` (a rank's manifest: its records, their constraints, the seal), ``generation`` (format version 3's
pointer, generations and base document, so a checkpoint changes by one compare-and-swap), ``verification_records`` (the
records ``verify-kernels`` writes: which restorer passed on which device kind).

What a checkpoint says about itself, and nothing about where it is stored or how it is read. Imports only
``errors``: everything else in the package may import it, and ``inspect`` and ``schema`` need nothing more.
"""
