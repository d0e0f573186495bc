"""Talking to the service: the HTTP client, response classes, the account, prices (map: ../__init__.py)."""
