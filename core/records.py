"""The shapes of the lines draftgen writes, documented next to the code that writes them.

`<dataset>/responses.jsonl` — one answered prompt per line:

    id                    str, the prompt id (integers in the prompt file are written as strings)
    messages              list, the messages sent (OpenAI format)
    reasoning             str | null, the model's reasoning text
    content               str, the answer text ("" when empty)
    tool_calls            list | null
    finish_reason         str | null ("stop", "length", ...)
    native_finish_reason  str | null, the provider's own
    provider              str | null, e.g. "Together"
    model                 str | null, the model that answered
    generation_id         str | null, OpenRouter's id (GET /generation?id=...)
    usage                 {prompt_tokens, completion_tokens, reasoning_tokens, cost}
    latency_s             float, the final attempt's wall time
    attempts              int, attempts made (1 = first try)
    truncated             bool, finish_reason == "length"
    empty_content         bool, no content (e.g. reasoning used up max_tokens)
    token_ids             list[int] | absent, completion token ids when the backend returned them
    ts                    float, unix time it was written

`<dataset>/failures.jsonl` — one prompt that failed for good per line:

    id, messages, error_kind (see ERROR_KINDS), status (HTTP status or null), message, attempts, ts

`<dataset>/rejected.jsonl` — one unusable input line per line:

    line (1-based line number in the prompt file), id (or null), reason, ts

`<dataset>/tokens/index.jsonl` metadata (beside id/offset/length, see core/tokens/store.py):

    answer_start, answer_end  token positions of the answer span [start, end) (after the <think>
                              that opens the assistant turn, through its <|im_end|>)
    valid                     bool, every validation check passed
    failed_checks             list[str], names from core/tokens/reconstruct.py CHECKS
    span_tokens               int, tokens in the answer span
    billed_tokens             int | null, usage.completion_tokens
    count_diff                int | null, span_tokens - billed_tokens
    truncated                 bool, copied from the response
    source                    "reconstructed" or "backend" (token ids the server returned)
"""

from __future__ import annotations

# Error kinds tallied in the UI and written in failures.jsonl.
ERROR_KINDS = (
    "429", "5xx", "timeout", "connection", "bad_body", "200_error", "finish_error", "empty_choices",
    "400", "401", "403", "402", "404_no_endpoints", "404", "other_4xx", "length", "moderated",
)
