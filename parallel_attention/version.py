"""The package version, in one place (setup.py reads it; the run guards compare it across ranks)."""

__version__ = "0.4.0"
