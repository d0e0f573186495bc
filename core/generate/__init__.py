"""Prompts in, answers on disk: generation, grouped by job. Each group imports only those above it in
this list (tests/test_layers.py checks that no two import each other):

api/       talking to the service: `client` (HTTP, streaming, errors), `answer` (what an answer's
           body says, a stream's chunks joined), `classify` (whose problem a
           response is), `account` (key, balance), `prices` (worst case of a request), `preflight`
           (the start-up check with causes), `limits` (open files for 2,000 connections), `fleet`
           (a list of self-hosted servers behind one run: spreading, taking out, probing).
money/     what it costs: `spend` (the spend ledger, spend.jsonl), `spend_file` (its one writer),
           `spend_sums` (reservations and sums behind the ceiling), `billing` (who pays for each
           attempt), `settle` (pricing abandoned generations), `budget` (token and money budgets),
           `forecast` (the whole-run projection), `reconcile` (`draftgen ledger`).
loop/      the run loop: `engine` (lifecycle and controls), `run_state` (`RunControl`, the run's one
           owner), `run_loop` (its parts, built once the run has opened), `context` (what every part
           reads, passed once), `opening` (what a run reads before its first request), `source` (where
           a dataset's prompts come from), `admission` (each dataset's loop over its source),
           `concurrency` (its limit, which adapts to 429s), `request`
           (one request from its admission to its record), `room` (whether one more request fits),
           `dataset_run` (a dataset's counts),
           `record_book` (each dataset's records on disk), `prompts` (a prompt line parsed),
           `prompt_files` (a prompt file read as a stream), `duplicates`, `doubts`, `watch`
           (the account while a run goes), `spool` and `spool_import`, `projection`, `stats`,
           `smoke_record` (what the last smoke test left for a run).
commands/  the one-shot commands around a run: `smoke`, `precheck` (the free checks before any paid
           request), `retry_failed`.
"""
