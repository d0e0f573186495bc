"""The one-shot commands around a run: smoke, precheck, retry-failed (map: ../__init__.py)."""
