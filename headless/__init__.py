"""The headless view: a run printed as lines for `tail -f`, a second view beside the TUI; both read
the engine's snapshot."""
