"""Plain data shared by every stage: what a request asks for, and what one step returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# Temperatures below this are greedy (vLLM's rule): logits divided by a tiny temperature overflow
# float32, and one that underflows float32 divides by zero; either way sampling gets NaN.
SAMPLING_EPS = 1e-5


class Grammar(Protocol):
    """A request's structured-output matcher as the scheduler and the engine drive it
    (structured/matcher.py's RequestGrammar), declared here, where a request holds it, so that
    this module needs nothing of the stages that use it."""

    error: str | None  # why its grammar does not compile, once resolved
    matcher: object | None  # None until compiled

    def resolve(self) -> bool: ...  # compiled (or failed): ready to start

    def advance(self, output_ids: list[int]) -> str | None: ...  # the tokens taken, or an error

    @property
    def constraining(self) -> object | None: ...  # the matcher whose mask applies this step


@dataclass(frozen=True)
class StructuredSpec:
    """A grammar the output must follow (structured outputs, enforced tool_choice).

    `kind` and `value`: "json_schema" (the schema as JSON text), "json_object" (value ""),
    "regex", "choice" (a JSON list of the allowed strings), "grammar" (Lark or GBNF text, as a
    client sends it), "lark" (a Lark grammar in the grammar engine's dialect, as the tool-call
    grammars are built). The grammar starts once the output ends with `after_ids` (the
    reasoning parser's end marker, so that reasoning stays free), or at once when it is empty.
    """

    kind: str
    value: str
    after_ids: tuple[int, ...] = ()


@dataclass
class SamplingParams:
    """Per-request sampling settings. No torch here: it crosses process boundaries."""

    temperature: float = 1.0
    top_k: int = -1  # <= 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context or the KV pool (the scheduler decides)
    stop_strs: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of alternatives per position; None means no logprobs at all (0 = sampled token only).
    logprobs: int | None = None
    # Vocabulary mask; a masked row that asks for logprobs gets them renormalised over these ids.
    allowed_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False
    # Ids whose logprobs each generated position reports instead of the top `logprobs`
    # (vLLM's field); from the same distribution as the sampled token's.
    logprob_token_ids: list[int] | None = None
    # Logit processing (engine/sample.py applies it in vLLM's order; raw logprobs ignore it).
    min_tokens: int = 0  # EOS and stop_token_ids banned, stop strings ignored, until this many
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] = field(default_factory=list)
    # bad_words as token sequences, filled in by the frontend's tokenizer before the engine sees it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Alternatives per prompt position; None: no prompt logprobs.
    prompt_logprobs: int | None = None
    # The first prompt token scored (label scoring: the label's first): the positions before
    # the one that scores it are not, so the prefix cache may supply them.
    prompt_logprobs_from: int = 1
    # Output text controls (the frontend's detokenizer).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured: StructuredSpec | None = None  # None: free output
    speculative: bool = True  # False: never drafted, where the server speculates
    # Embeddings: "last", "mean" or "cls"; the first message carries the prompt's final-norm
    # hidden states pooled so (engine/pooling.py). None: a generation request.
    pooling: str | None = None

    @property
    def is_greedy(self) -> bool:
        # top_k == 1 keeps only the argmax, whatever the temperature or top_p.
        return self.temperature < SAMPLING_EPS or self.top_k == 1


@dataclass
class TokenLogprob:
    """Logprob data of one sampled position.

    `logprob` and `top_*` come from the raw distribution, or from the distribution renormalised
    over `allowed_token_ids` when the request set them. `rank` is 1-based.
    """

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Req:
    """A request inside the engine process: its ids, its KV slots and how far it has got."""

    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    # KV slot of every token whose KV is in the pool, in sequence order.
    slots: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # Its sampling stream, made when it is added and kept across preemptions: a seeded stream
    # continues where it was.
    generator: torch.Generator | None = None
    # With params.prompt_logprobs, until its first message carries them: the entries of the
    # prompt tokens scored so far, from [None] (the first token has no context).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With params.structured: its matcher, made when it is added and kept across preemptions
    # (the output it has consumed is kept too).
    grammar: Grammar | None = None
    # Hybrid models: its slot in the engine's recurrent-state pool while running, and the
    # snapshot slots the next step fills at chunk boundaries of its prompt ({position: slot}).
    state_slot: int | None = None
    snapshots: dict[int, int] = field(default_factory=dict)
    # Speculative decoding (scheduler/speculation.py): whether it is drafted at all (False where
    # it opted out, under a grammar, or once its MTP drafts were retired); the tokens this step
    # verifies after its last one; the longest its next draft may be (0: the server's), how many
    # coming steps it decodes plainly after drafts were rejected, its draft tokens' recent
    # (decayed) accepts and rejects, and the MTP drafts' window of tokens tried and accepted.
    drafting: bool = True
    drafts: list[int] = field(default_factory=list)
    draft_length: int = 0
    draft_pause: int = 0
    draft_backoff: int = 0
    draft_hits: float = 0.0
    draft_misses: float = 0.0
    draft_match: int = 0  # the n-gram length that found its last prompt-lookup draft
    window_tried: int = 0
    window_accepted: int = 0
    # MTP drafting (engine/mtp.py): the main model's final-norm hidden state at its last computed
    # position, as (position, state).
    mtp_hidden: tuple[int, torch.Tensor] | None = None
    # With params.pooling: the final-norm hidden state of each prompt position it reads, so far.
    hidden: dict[int, torch.Tensor] | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens without KV: 1 while decoding, more while its prompt (or after a preemption,
        its prompt and output so far) is being prefilled."""
        return len(self.prompt_ids) + len(self.output_ids) - len(self.slots)

    @property
    def num_computed(self) -> int:
        return len(self.slots)


@dataclass
class Batch:
    """One forward: each request contributes `new_ids` (a prefill chunk, one decode token, or one
    decode token and its drafts).

    `logit_reqs` are the requests that sample this step (a chunked prefill that has not reached
    its last prompt token does not). They keep the order of `reqs`, and the model returns
    1 + len(req.drafts) logit rows per entry, in that order.

    `prompt_rows` are the requests that score their prompt (prompt logprobs), each with the
    number n of its new tokens, from the first, whose next token is a prompt token. After the
    sampling rows, the model returns n rows per entry, in that order, the row of a token giving
    the distribution of the token after it.
    """

    reqs: list[Req]
    new_ids: list[list[int]]
    logit_reqs: list[Req]
    prompt_rows: list[tuple[Req, int]] = field(default_factory=list)
