"""Prompt files from datasets where users keep them (`draftgen prompts build`).

sources.py opens a dataset (the `datasets` library, an optional extra); presets.py maps a row to
the prompt messages; language.py is the language filter; split.py measures, histograms and splits
by prompt length; build.py runs it all and writes the JSONL prompt files; configfile.py writes the
`[[datasets]]` entries. Nothing here is imported by a run: the core install stays light.
"""
