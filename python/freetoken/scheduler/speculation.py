"""Speculative decoding by prompt lookup (n-gram): drafts proposed here, verified by the engine.

A request's draft is the k tokens that followed the latest earlier occurrence of its last n
tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`). The engine runs the request's
last token and its draft as k + 1 decode rows, each attending to exactly the keys a plain
decode step at its position would, and samples the rows in order: the first row whose token
differs from the draft ends the step, its token emitted in place of the draft's. Row-invariant
kernels give each row the bits of a plain decode step, and a seeded request's random stream is
rewound to the draws its emitted tokens used, so its output is the plain one, bit for bit.

A request's next draft is one token longer than what its last draft had accepted (up to
`num_speculative_tokens`), and a request whose draft had nothing accepted stops drafting for a
while (twice as long each time, up to `MAX_PAUSE` steps), so that rows verified in vain stay
few where text does not repeat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.config import SpeculativeConfig
from freetoken.core import Req

MAX_PAUSE = 32


def lookup(ids: list[int], config: SpeculativeConfig, most: int) -> list[int]:
    """Up to `most` tokens that followed the latest earlier occurrence of the longest suffix of
    `ids` (prompt_lookup_max tokens down to prompt_lookup_min) that occurred before."""
    if most <= 0:
        return []
    seq = np.asarray(ids, dtype=np.int64)
    for n in range(min(config.prompt_lookup_max, len(ids) - 1), config.prompt_lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return ids[follow : follow + most]
    return []


@dataclass
class SpecStats:
    """Counters for /v1/stats and /metrics, as vLLM names them."""

    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0  # by steps that verified a draft, bonus tokens too


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecStats()

    def propose(self, req: Req) -> list[int]:
        """The draft for `req`'s next step, empty when it should decode plainly."""
        if not speculates(req):
            return []
        if req.draft_pause > 0:
            req.draft_pause -= 1
            return []
        # The bonus token counts against max_tokens too: k drafts emit up to k + 1 tokens.
        room = req.params.max_tokens - len(req.output_ids) - 1
        return lookup(req.all_ids, self.config, min(req.draft_length or self.config.num_speculative_tokens,
                                                     room))

    def verified(self, req: Req, drafts: list[int], accepted: int, emitted: int) -> None:
        self.stats.spec_decode_num_drafts += 1
        self.stats.spec_decode_num_draft_tokens += len(drafts)
        self.stats.spec_decode_num_accepted_tokens += accepted
        self.stats.spec_decode_num_emitted_tokens += emitted
        req.draft_length = min(accepted + 1, self.config.num_speculative_tokens)
        if accepted:
            req.draft_backoff = 0
        else:
            req.draft_backoff = min(2 * req.draft_backoff or 1, MAX_PAUSE)
            req.draft_pause = req.draft_backoff


def speculates(req: Req) -> bool:
    """Whether the request takes drafts: not where it opted out, nor under a grammar, whose
    matcher would have to follow the draft and be rolled back, which it does not do."""
    return req.params.speculative and req.params.structured is None
