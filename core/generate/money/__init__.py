"""What a run costs: the spend ledger, reservations, billing, budgets, projections (map: ../__init__.py)."""
