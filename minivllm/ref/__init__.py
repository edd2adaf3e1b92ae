"""Readable pure-torch reference implementations, one module per component.

Each module here has a twin of the same name in :mod:`minivllm.fast` with the
same public names and signatures. :mod:`minivllm.backend` picks one.
"""
