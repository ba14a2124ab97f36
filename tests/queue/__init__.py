"""Serving a queue: both queue paths, the lifecycle table, copy modes, hooks."""
