"""The run loop: engine, its owner, admission, attempts, records on disk (map: ../__init__.py)."""
