"""The manifest as data: its schema (every record, encoding, the JSON schema) and the verification records.

What a checkpoint says about itself, and nothing about where it is stored or how it is read. Imports only
``errors``: everything else in the package may import it, and ``inspect`` and ``schema`` need nothing more.
"""
