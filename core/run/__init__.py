"""Orchestration: the pipeline that drives a run's stages (smoke, generation, tokens, merge, extract)
and the stages it starts. The top layer of core: it imports every stage; nothing in core imports it."""
