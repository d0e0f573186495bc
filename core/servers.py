"""Which self-hosted server answers, and how each of its releases takes a request for token ids.

A vLLM or SGLang server returns the token ids it generated when asked, but each release asks and
answers differently (read from the released wheels; tests/servers/test_server_contract.py checks them):

    vLLM >= 0.10.2   `return_token_ids`: the choice's `token_ids`, the response's `prompt_token_ids`
                     (streamed: each chunk's `token_ids` delta, the prompt ids in the first chunk).
                     Before 0.13 a streamed step that the reasoning or tool parser swallows (the
                     `</think>` step) is skipped with its ids: streamed ids are not asked there.
    SGLang <= 0.5.16 no completion ids at all: `return_token_ids` is ignored without a word.
    SGLang 0.5.17    `return_token_ids` (non-streamed only: a stream with it is refused, 400): the
                     choice's `token_ids` and `prompt_token_ids`.
    SGLang >= 0.5.18 the same key, the choice's field renamed `response_token_ids`.
    SGLang >= 0.5.20 streamed: `return_output_ids_in_sglext` / `return_input_ids_in_sglext`, read
                     from the response's `sglext.output_ids` (one list per choice) and `sglext.input_ids`.

The server and its release are asked once at run start (`GET /version` answers vLLM's; SGLang's
`GET /server_info` or, in every release named here, `GET /get_server_info` carries `version`), and
noted in the run's `ServerProfile` beside the server's kind. An unknown server is
asked the vLLM way, which every server named here takes non-streamed; what does not come back is
counted in the run (`no_ids`), never silently missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from draftgen.core.server_kinds import OpenRouter, ServerKind

VLLM = "vllm"
SGLANG = "sglang"
# Request keys that ask for ids, whichever server: left out of the request shape the smoke test
# fingerprints (it holds `return_token_ids` as the config's switch), so that the release found at
# run start never makes the smoke test stale.
IDS_KEYS = ("return_token_ids", "return_output_ids_in_sglext", "return_input_ids_in_sglext")


def parse_version(text: Any) -> tuple[int, ...] | None:
    """(0, 5, 17) of "0.5.17", "0.5.17.post1" or "0.13.0rc2+cu129"; None when it is not a version."""
    if not isinstance(text, str):
        return None
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


@dataclass(frozen=True)
class Server:
    """A self-hosted server as it said it is: `name` vllm or sglang, `version` as parsed."""
    name: str
    version: tuple[int, ...]
    text: str = ""  # the version as the server wrote it

    @property
    def label(self) -> str:
        return f"{'vLLM' if self.name == VLLM else 'SGLang'} {self.text or '.'.join(map(str, self.version))}"

    def at_least(self, *version: int) -> bool:
        return self.version >= version

    def ids_request(self, streamed: bool) -> dict[str, Any]:
        """The keys that ask this release for its ids in this mode ({} where it has none to give)."""
        if self.name == VLLM:
            if not self.at_least(0, 10, 2) or (streamed and not self.at_least(0, 13)):
                return {}
            return {"return_token_ids": True}
        if streamed:
            return ({"return_output_ids_in_sglext": True, "return_input_ids_in_sglext": True}
                    if self.at_least(0, 5, 20) else {})
        return {"return_token_ids": True} if self.at_least(0, 5, 17) else {}

    def no_ids_reason(self, streamed: bool) -> str:
        """Why this release gives no ids in this mode, and the fix ("" when it gives them)."""
        if self.ids_request(streamed):
            return ""
        if self.name == VLLM:
            if streamed and self.at_least(0, 10, 2):
                return (f"{self.label} streams ids without the steps its reasoning or tool parser swallows (the "
                        "`</think>` step; fixed in 0.13): ids are not asked of its streams; set [api] stream = "
                        "false for the server's own ids, or upgrade vLLM to 0.13 or later")
            return f"{self.label} has no `return_token_ids` (from 0.10.2): upgrade vLLM for the server's own ids"
        if streamed and self.at_least(0, 5, 17):
            return (f"{self.label} streams no ids (sglext ids from 0.5.20; `return_token_ids` is refused on a "
                    "stream): set [api] stream = false for the server's own ids, or upgrade SGLang to 0.5.20")
        return (f"{self.label} has no `return_token_ids` (it ignores the key; from 0.5.17): upgrade SGLang "
                "for the server's own ids")


def server_from_answers(version: Any = None, server_info: Any = None) -> Server | None:
    """The server an answer of `GET /version` (vLLM: {"version": ...}) or `GET /server_info` /
    `/get_server_info` (SGLang: the server args with "version") says it is; None when neither does."""
    if isinstance(server_info, dict):
        v = parse_version(server_info.get("version"))
        if v is not None:
            return Server(SGLANG, v, str(server_info.get("version")))
    if isinstance(version, dict):
        v = parse_version(version.get("version"))
        if v is not None:
            return Server(VLLM, v, str(version.get("version")))
    return None


def ids_request(server: Server | None, streamed: bool) -> dict[str, Any]:
    """The keys that ask for ids: the release's own, else (an unknown server) `return_token_ids`."""
    return server.ids_request(streamed) if server is not None else {"return_token_ids": True}


class ServerProfile:
    """What one run found of the server at its [api] base_url: its kind (core/server_kinds.py: the one
    configured, or what GET /key answered), its release (GET /version, /server_info), the streaming mode
    its smoke test decided. Each run's config carries its own (`ApiConfig.server`, made fresh by every
    load), filled in at the run's start, before any request: two runs in one process, or a server
    restarted on the same address as another kind, never share what was found. Read through `kind`,
    `ApiConfig.streams` and `Config.request_body`.

    `epoch` counts the notes: a request body built before a note may be out of date (loop/room.py keeps
    one per dataset rather than rebuilding it per prompt)."""

    __slots__ = ("configured", "found", "release", "asked", "stream", "epoch")

    def __init__(self, configured: ServerKind | None = None) -> None:
        self.configured = configured  # what [api] kind and base_url decide (None: "auto" elsewhere)
        self.found: ServerKind | None = None       # what GET /key answered ("auto"; None: not known yet)
        self.release: Server | None = None   # None: not asked, or it named no release (see `asked`)
        self.asked = False                   # whether the server was asked which release it is
        self.stream: bool | None = None      # the mode a smoke test decided (None: none decided)
        self.epoch = 0

    @property
    def kind(self) -> ServerKind:
        """The run's kind: the one configured, else the one found; before the server answered, OpenRouter
        (its checks are the stricter ones)."""
        return self.configured or self.found or _OPENROUTER

    def configure(self, kind: ServerKind | None) -> None:
        """The kind the config decides (ApiConfig, as it is made)."""
        self.configured = kind

    def note_kind(self, kind: ServerKind) -> None:
        """The kind the server's answer showed (GET /key, for "auto")."""
        self.found = kind
        self.epoch += 1

    def note_release(self, server: Server | None) -> None:
        self.release, self.asked = server, True
        self.epoch += 1

    def note_stream(self, streams: bool | None) -> None:
        """Record (or, with None, forget) the streaming mode a smoke test decided for this server."""
        self.stream = streams
        self.epoch += 1


_OPENROUTER = OpenRouter()


def ids_plan(server: Server | None, base_url: str, streamed: bool) -> tuple[bool, str]:
    """(whether ids are asked, a sentence saying how or why not) for the run's events."""
    mode = "streamed" if streamed else "non-streamed"
    if server is None:
        return True, (f"the server at {base_url} names no release (GET /version, /server_info): its token ids are "
                      "asked with return_token_ids; answers without them are counted (no_ids)")
    keys = server.ids_request(streamed)
    if not keys:
        return False, server.no_ids_reason(streamed)
    return True, f"{server.label} at {base_url}: token ids asked with {', '.join(keys)} ({mode})"


def missing_ids_message(server: Server | None, base_url: str, streamed: bool) -> str:
    """What an answer without the ids asked for means, and the fix."""
    if server is not None and (reason := server.no_ids_reason(streamed)):
        return f"answers come without token ids: {reason}"
    who = server.label if server is not None else f"the server at {base_url}"
    return (f"{who} answered without the token ids asked for ([api] return_token_ids; SGLang 0.5.16 and earlier "
            "ignore the key without a word): those samples' ids are reconstructed from the text; upgrade the "
            "server (vLLM 0.10.2+, SGLang 0.5.17+), or set [api] return_token_ids = false; counted as no_ids")
