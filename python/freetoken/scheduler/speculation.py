"""Speculative decoding: drafts proposed here (prompt lookup) or by the model's MTP head
(engine/mtp.py), sized here, verified by the engine.

A prompt-lookup draft is the k tokens that followed the latest earlier occurrence of its last n
tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`). The engine runs the request's
last token and its draft as k + 1 decode rows, each attending to exactly the keys a plain
decode step at its position would, and samples the rows in order: the first row whose token
differs from the draft ends the step, its token emitted in place of the draft's. Row-invariant
kernels give each row the bits of a plain decode step, and a seeded request's random stream is
rewound to the draws its emitted tokens used, so its output is the plain one, bit for bit.

A draft's rows are not free: a decode step costs about a + b * rows (the GEMMs and the sampler
per row), and at 8 or more requests the rows' share of the step is large. So a draft's j-th
token is proposed only where it pays for its row: where the chance that it is accepted (a
per-token acceptance rate, to the j-th power: the request's recent drafts pooled with the
server's recent drafts found by a match of the same n-gram length) is at least the share
b * B / (a + b * B) of a plain step of B rows that one row's worth of work is, with a and b
fitted on the server's recent decode steps (`StepCost`); until the fit knows them, one
request a step gets a prompt-lookup draft (so that a batch's first steps do not verify every
request's whole draft at a cost nobody knows). Besides, a request's next draft is at most one
token longer than what its last draft had accepted (up to `num_speculative_tokens`), and a
request whose draft had nothing accepted, or whose drafts do not pay, stops drafting for a
while (twice as long each time, up to `MAX_PAUSE` steps) and then, where its match is 2 tokens
long or more, tries one token.

MTP drafts cost more than their rows: every step writes the head's K/V of the drafting requests'
rows (engine/mtp.py), paused or not, and a draft runs the head and the LM head per token. So an
MTP request's first draft is one token long, and it is not paused (but for one step after a
rejected draft while the step cost is not known, so that steps of different row counts come): it
drafts what pays, and its tokens tried (a step where no token pays counts as one rejected) are
judged in windows of `MTP_WINDOW`; a window with fewer than `MTP_FLOOR` of them accepted retires
the request from drafting for good (`Req.drafting`), and the head's pass skips its rows from
then on. It cannot come back: the head's K/V of the positions it skipped are not written, and a
draft reads them all.

The fit above sizes drafts but misjudges what they cost (on free text it rated a row cheaper than
drafted steps turned out to be, and drafting lost 10 %), so whether a step drafts at all is
measured (`ModeChoice`): per bucket of decoding requests (1, 2-3, 4-7, 8+), steps run in epochs
either drafting as above or plain, and the steps with drafts and those without (a drafting step
where no request drafted is a plain step) each keep their emitted tokens and wall seconds (decayed
per step of that kind, so that they follow the text and the machine). An epoch runs the mode whose
kind of step emits more tokens a second; a bucket drafts until its drafted steps are measured,
tries plain where its steps without drafts are not, and tries the slower mode again (`TRY` steps)
after a streak of the faster one as long as the gap between them is wide, so that each try costs
about as much; the first steps of a bucket after another bucket's are not measured. Drafts never
change outputs, so a step may switch either way: a plain step proposes no draft and counts toward
pauses; it counts as one rejected token in an MTP request's window (so that a request whose
bucket keeps drafting off is retired and the head's pass stops), and until then the head's pass
still writes its drafting requests' K/V, so that their drafts can resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from freetoken.config import SpeculativeConfig
from freetoken.core import Req, SamplingParams

MAX_PAUSE = 32
# MTP: tokens tried per verdict, and the accepted share below which a request stops drafting.
MTP_WINDOW = 8
MTP_FLOOR = 0.1
# A request's acceptance counts decay by this per verified draft: its rate follows its text.
ACCEPT_DECAY = 0.7
# The acceptance by n-gram length decays by this per verified draft of that length: it follows
# the server's recent text, over more drafts than a request has.
MATCH_DECAY = 0.9
# The step-cost fit forgets older steps by this per step (about the last 50 weigh).
COST_DECAY = 0.98
# ModeChoice: steps per epoch, and per try of the slower mode (plain's first one too); the steps
# of each kind measured before the two are compared; the slower mode is tried after EXPLORE *
# (1 - slower / faster) epochs of the faster (at least 2, at most MAX_STREAK); a kind's tokens
# and seconds decay by RATE_DECAY per step of it (about its last 10 steps weigh).
EPOCH = 4
TRY = 2
MIN_STEPS = 2
EXPLORE = 60
MAX_STREAK = 16
RATE_DECAY = 0.9
UNMEASURED = 2  # steps of a bucket after another's that are not measured


def lookup(ids: list[int], config: SpeculativeConfig, most: int) -> tuple[int, list[int]]:
    """(n, up to `most` tokens that followed the latest earlier occurrence of the longest suffix
    of `ids`, n tokens long, from prompt_lookup_max down to prompt_lookup_min, that occurred
    before); (0, []) where none did."""
    if most <= 0:
        return 0, []
    seq = np.asarray(ids, dtype=np.int64)
    for n in range(min(config.prompt_lookup_max, len(ids) - 1), config.prompt_lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return n, ids[follow : follow + most]
    return 0, []


@dataclass
class SpecStats:
    """Counters for /v1/stats and /metrics, as vLLM names them."""

    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0  # by steps that verified a draft, bonus tokens too


class StepCost:
    """Decode step seconds as a + b * rows, a least-squares fit over recent decode steps (drafts'
    lookups, rows and sampling included), older steps weighing less."""

    def __init__(self):
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = COST_DECAY
        self.n, self.x, self.y = d * self.n + 1, d * self.x + rows, d * self.y + seconds
        self.xx, self.xy = d * self.xx + rows * rows, d * self.xy + rows * seconds

    @property
    def known(self) -> bool:
        """Whether the fit has seen enough steps of different row counts to tell a from b."""
        # Rows of 1 and 2 in turn have a variance of 0.25 (less, weighed by age).
        return self.n >= 4 and self.xx / self.n - (self.x / self.n) ** 2 >= 0.2

    def row_share(self, rows: int) -> float:
        """The share of a step of `rows` rows that one row's worth of work is times `rows`
        (b * rows / (a + b * rows)); 0 until the fit is `known`."""
        if not self.known:
            return 0.0
        mean_x, mean_y = self.x / self.n, self.y / self.n
        var = self.xx / self.n - mean_x * mean_x
        b = max((self.xy / self.n - mean_x * mean_y) / var, 0.0)
        a = max(mean_y - b * mean_x, 0.0)
        return b * rows / (a + b * rows) if b > 0 else 0.0


@dataclass
class _Bucket:
    """One bucket of decoding request counts: per kind of step (index 0 plain, 1 with drafts),
    the decayed emitted tokens and seconds and the steps measured; the mode of the running epoch,
    its steps left, and the epochs of the faster mode since the slower one was last tried."""

    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    steps: list[int] = field(default_factory=lambda: [0, 0])
    drafting: bool = True
    left: int = EPOCH
    streak: int = 0

    def next_epoch(self) -> None:
        if self.steps[1] < MIN_STEPS:
            # Drafting until its drafted steps are measured: it costs nothing where none drafts.
            self.drafting, self.left = True, EPOCH
            return
        if self.steps[0] < MIN_STEPS:
            self.drafting, self.left = False, TRY
            return
        plain, drafted = (t / s for t, s in zip(self.tokens, self.seconds))
        fast = max(plain, drafted)
        gap = 1 - min(plain, drafted) / fast if fast else 0.0
        # A try loses about the gap on its TRY steps in 4 * streak: under 1 % of the throughput
        # whatever the gap, 1.2 % at most for a gap above 27 %.
        try_slower = self.streak >= min(max(round(EXPLORE * gap), 2), MAX_STREAK)
        self.streak = 0 if try_slower else self.streak + 1
        self.drafting = (drafted >= plain) != try_slower
        self.left = TRY if try_slower else EPOCH

    def observe(self, drafted: bool, seconds: float, tokens: int) -> None:
        self.tokens[drafted] = RATE_DECAY * self.tokens[drafted] + tokens
        self.seconds[drafted] = RATE_DECAY * self.seconds[drafted] + seconds
        self.steps[drafted] += 1


class ModeChoice:
    """Whether a decode step drafts, by the measured tokens a second of steps that did and did
    not (see the module's docstring)."""

    def __init__(self):
        self.buckets: dict[int, _Bucket] = {}
        self.current: _Bucket | None = None
        self.requests = 0  # the current step's decoding requests
        self.run = 0  # steps in a row of the current step's bucket, this one included

    def drafts(self, requests: int) -> bool:
        """Whether this decode step, of `requests` decoding requests, drafts."""
        bucket = self.buckets.setdefault(min(requests.bit_length(), 4), _Bucket())
        if bucket.left == 0:
            bucket.next_epoch()
        bucket.left -= 1
        self.run = self.run + 1 if bucket is self.current else 1
        self.current, self.requests = bucket, requests
        return bucket.drafting

    def observe(self, rows: int, seconds: float, tokens: int) -> None:
        """The step `drafts` was last asked about ran `rows` rows, took `seconds` and emitted
        `tokens`. A drafting step in which no request drafted counts as a plain step, which it
        is; the first steps of a bucket after another's (requests came or went, so a prompt was
        likely prefilled in between) are slow whatever their mode: not counted."""
        if self.current is not None and self.run > UNMEASURED:
            self.current.observe(rows > self.requests, seconds, tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecStats()
        self.cost = StepCost()
        self.mode = ModeChoice()
        # Per n-gram length: the decayed accepts and rejects of the drafts its matches found.
        self.matches: dict[int, tuple[float, float]] = {}

    def propose(self, req: Req, batch_rows: int) -> list[int]:
        """The prompt-lookup draft for `req`'s next step in a decode step of `batch_rows` plain
        rows, empty when it should decode plainly."""
        most = self._most(req)
        if most <= 0:
            return []
        req.draft_match, draft = lookup(req.all_ids, self.config, most)
        if not draft:
            return []
        hits, misses = self.matches.get(req.draft_match, (0.0, 0.0))
        return draft[: self._paying(req, len(draft), batch_rows, acceptance(req, hits, misses))]

    def length(self, req: Req, batch_rows: int) -> int:
        """How many tokens `req`'s next MTP draft should have in a decode step of `batch_rows`
        plain rows: 0 where it should decode plainly."""
        most = self._most(req)
        return self._paying(req, most, batch_rows, acceptance(req)) if most > 0 else 0

    def _most(self, req: Req) -> int:
        """The longest draft `req` may have next: 0 while it is not drafted or pauses."""
        if not req.drafting:
            return 0
        if req.draft_pause > 0:
            req.draft_pause -= 1
            return 0
        # The bonus token counts against max_tokens too: k drafts emit up to k + 1 tokens.
        room = req.params.max_tokens - len(req.output_ids) - 1
        # An MTP draft's tokens are each a pass of the head and the LM head: its first is one long.
        first = 1 if self.config.method == "mtp" else self.config.num_speculative_tokens
        return min(req.draft_length or first, room)

    def _paying(self, req: Req, most: int, batch_rows: int, rate: float) -> int:
        """How many of `most` draft tokens pay for their rows at per-token acceptance `rate`."""
        share = self.cost.row_share(batch_rows)
        paying = 0
        while paying < most and rate ** (paying + 1) >= share:
            paying += 1
        if paying:
            return paying
        if self.config.method == "mtp":
            self._judge(req, 1, 0)
            return 0
        # No token pays its row: decode plainly for a while; after a pause, a match of 2 tokens or
        # more (text that starts to repeat; a lone repeated token is no sign) tries one token.
        probe = req.draft_backoff > 0 and req.draft_match > 1
        self._pause(req)
        return int(probe)

    def verified(self, req: Req, drafts: list[int], accepted: int, emitted: int) -> None:
        self.stats.spec_decode_num_drafts += 1
        self.stats.spec_decode_num_draft_tokens += len(drafts)
        self.stats.spec_decode_num_accepted_tokens += accepted
        self.stats.spec_decode_num_emitted_tokens += emitted
        req.draft_length = min(accepted + 1, self.config.num_speculative_tokens)
        req.draft_hits = ACCEPT_DECAY * req.draft_hits + accepted
        req.draft_misses = ACCEPT_DECAY * req.draft_misses + (accepted < len(drafts))
        if req.draft_match:
            hits, misses = self.matches.get(req.draft_match, (0.0, 0.0))
            self.matches[req.draft_match] = (MATCH_DECAY * hits + accepted,
                                             MATCH_DECAY * misses + (accepted < len(drafts)))
        if self.config.method == "mtp":
            self._judge(req, len(drafts), accepted)
            if not accepted and not self.cost.known:  # a plain step between: rows the fit can tell
                req.draft_pause = 1
            return
        if req.draft_pause:  # a token tried after a pause: the next pause has begun
            return
        if accepted:
            req.draft_backoff = 0
        else:
            self._pause(req)

    def observe(self, rows: int, seconds: float, tokens: int) -> None:
        """A decode step of `rows` rows took `seconds`, its drafts' lookups and sampling
        included, and emitted `tokens`."""
        self.cost.observe(rows, seconds)
        self.mode.observe(rows, seconds, tokens)

    def rest(self, reqs: list[Req]) -> None:
        """A step the measured choice runs plain: it counts toward the requests' pauses, and as
        one rejected token in an MTP request's window (drafts measured slower than plain steps
        do not pay for the head's pass: a bucket that keeps them off retires its requests)."""
        for req in reqs:
            req.draft_pause = max(req.draft_pause - 1, 0)
            if self.config.method == "mtp" and req.drafting:
                self._judge(req, 1, 0)

    @staticmethod
    def _judge(req: Req, tried: int, accepted: int) -> None:
        """Count an MTP request's tokens tried and accepted; a full window with too few accepted
        retires it."""
        req.window_tried += tried
        req.window_accepted += accepted
        if req.window_tried >= MTP_WINDOW:
            if req.window_accepted < MTP_FLOOR * req.window_tried:
                req.drafting = False
            req.window_tried = req.window_accepted = 0

    @staticmethod
    def _pause(req: Req) -> None:
        req.draft_backoff = min(2 * req.draft_backoff or 1, MAX_PAUSE)
        req.draft_pause = req.draft_backoff


def acceptance(req: Req, hits: float = 0.0, misses: float = 0.0) -> float:
    """The chance that `req`'s next draft token is accepted, given its last ones and `hits` and
    `misses` more (those of its match's length), with a prior of one accept and one reject."""
    return (req.draft_hits + hits + 1) / (req.draft_hits + req.draft_misses + hits + misses + 2)


def speculates(params: SamplingParams) -> bool:
    """Whether a request takes drafts: not where it opted out, nor under a grammar, whose
    matcher would have to follow the draft and be rolled back, which it does not do."""
    return params.speculative and params.structured is None
