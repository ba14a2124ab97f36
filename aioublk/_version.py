"""aioublk's version: the one place it is written. pyproject.toml reads it
(``dynamic = ["version"]``) so the installed metadata agrees, and nothing
reads the metadata at run time: importlib.metadata costs seconds per
command in an emulated guest."""

__version__ = "0.1.0"
