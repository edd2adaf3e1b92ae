"""Test support: the pytest plugin (``--backend``) and shared hypothesis strategies."""
