"""Lossless speculative decoding: who drafts, how deep a step drafts, and what it earned.

A draft of ``k`` tokens is verified by one forward pass of ``k + 1`` rows (the last token
and the drafts). Every row computes exactly what a one-token decode would (engine.batch),
so the model's token at each position is the one plain decoding would pick: greedy, or
sampled with the request's next random number. A draft is kept while it equals that
token; the first that differs is replaced by it and the rest are dropped with their KV
rows. So speculation changes no token and no random draw: with the same seed the text is
the same with or without it, at any depth. For a drafter that proposes one token (a point
mass q), keeping the draft exactly when the model's own sample equals it is the standard
rejection rule, accept with probability min(1, p/q) = p(draft), with the same
distribution for the replacement token; it is simply also reproducible.

How deep: a verify of ``k`` drafts costs the pass time of ``k + 1`` rows (more rows route
to more experts: more bytes from disk or memory, more arithmetic) and earns the expected
number of tokens it emits, ``1 + p1 + p1 p2 + ...`` with ``p_i`` the request's measured
rate of accepting the i-th draft after the ones before it. `PassCosts` measures seconds
per pass by its row count as the engine runs (the disk's and the cores' rates are in
there: a streamed pass grows slowly with rows, its reads are shared; a resident one grows
with the arithmetic), and each step takes the depth with the most tokens per second,
often 0. Every `EXPLORE_EVERY` steps a request that stopped drafting tries one draft, so
its rates stay measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from colibrid.errors import RequestError

MODES = ("off", "ngram", "mtp", "auto")
DEFAULT_MAX_DEPTH = 8
MAX_DEPTH_LIMIT = 32
NGRAM_MAX = 4  # longest context suffix matched by prompt lookup
NGRAM_MIN = 2  # shortest: one token recurs too often to predict what follows
EXPLORE_EVERY = 16
COST_ROWS = 64  # pass sizes modelled (bigger passes are prefills: not a verify's cost)
COST_WEIGHT = 0.2  # weight of a new measurement in a row count's running mean
PRIOR_SLOPE = 0.5  # extra pass time per extra row, as a share of one row's, before data
PRIOR_TRIES = 2.0  # weight of a draft depth's prior acceptance rate, in tries
FALLBACK_TRIES = 6  # first drafts an expensive drafter gets before it may be dropped...
FALLBACK_RATE = 0.1  # ...for prompt lookup, when fewer than this share of them were kept


@dataclass(frozen=True)
class SpecSettings:
    """`mode`: off, ngram (prompt lookup), mtp (the checkpoint's MTP layer) or auto (MTP
    where the model has it, else prompt lookup); `max_depth`: the deepest draft."""

    mode: str = "auto"
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RequestError(f"speculate must be one of {', '.join(MODES)}, got {self.mode!r}")
        if (
            not isinstance(self.max_depth, int)
            or isinstance(self.max_depth, bool)
            or not 1 <= self.max_depth <= MAX_DEPTH_LIMIT
        ):
            raise RequestError(
                f"draft depth must be an integer in [1, {MAX_DEPTH_LIMIT}], got {self.max_depth!r}"
            )

    @property
    def on(self) -> bool:
        return self.mode != "off"


OFF = SpecSettings("off")


class PromptLookup:
    """Drafts by prompt lookup: the tokens that followed the latest earlier occurrence of
    the context's last n tokens (n from NGRAM_MAX down to NGRAM_MIN). Costs no model
    pass; it pays on answers that repeat their input (code edits, summaries, JSON)."""

    name = "ngram"
    free = True

    def __init__(self) -> None:
        self._tokens: list[int] = []
        # n-gram -> index of the token that followed its latest occurrence
        self._after: dict[tuple[int, ...], int] = {}

    def feed(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self._tokens.append(int(t))
            end = len(self._tokens) - 1  # the new token follows the n-grams ending before it
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    self._after[tuple(self._tokens[end - n : end])] = end

    def cost(self, depth: int) -> float:
        """Seconds `depth` drafts take: a dictionary lookup, nothing to price."""
        return 0.0

    def keep_up(self) -> None:
        pass

    def propose(self, limit: int) -> list[int]:
        toks = self._tokens
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(toks) < n:
                continue
            start = self._after.get(tuple(toks[-n:]))
            if start is not None:
                return toks[start : start + limit]
        return []


class PassCosts:
    """Seconds of a forward pass by its row count, measured as passes run (one per engine:
    every request's depth choice prices its rows with it)."""

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}
        self._seen: dict[int, int] = {}
        self.sharing = 0  # other requests decoding beside (a row each): set by the driver

    def observe(self, rows: int, seconds: float) -> None:
        if not 1 <= rows <= COST_ROWS or not seconds > 0:
            return
        old = self._mean.get(rows)
        self._mean[rows] = seconds if old is None else old + COST_WEIGHT * (seconds - old)
        self._seen[rows] = self._seen.get(rows, 0) + 1

    def seconds(self, rows: int) -> float | None:
        """Measured, else interpolated between measured row counts, else extrapolated
        from the measured slope (or PRIOR_SLOPE); None before any pass was timed."""
        if rows <= 0:
            return 0.0
        if rows in self._mean:
            return self._mean[rows]
        known = sorted(self._mean)
        if not known:
            return None
        lower = [r for r in known if r < rows]
        upper = [r for r in known if r > rows]
        if lower and upper:
            a, b = lower[-1], upper[0]
            ta, tb = self._mean[a], self._mean[b]
            return ta + (tb - ta) * (rows - a) / (b - a)
        base_rows = known[0]
        base = self._mean[base_rows]
        slope = PRIOR_SLOPE * base / base_rows
        if len(known) >= 2:
            first, last = known[0], known[-1]
            slope = max(0.0, (self._mean[last] - self._mean[first]) / (last - first))
        edge = lower[-1] if lower else upper[0]
        return max(self._mean[edge] + slope * (rows - edge), 1e-9)


@dataclass
class SpecStats:
    """What speculation did for one request (DONE's STAT extras, `-v`, `ps`)."""

    costs: PassCosts = field(repr=False)
    mode: str = "off"
    verifies: int = 0  # passes that carried drafts
    drafted: int = 0
    accepted: int = 0
    depth_sum: int = 0
    predicted_gain_sum: float = 0.0  # the chosen depth's expected speed-up, per verify
    spec_seconds: float = 0.0  # pass time of the verifies
    spec_tokens: int = 0  # tokens those passes emitted
    plain_seconds: float = 0.0  # pass time of plain one-row decode steps
    plain_tokens: int = 0

    @property
    def mean_depth(self) -> float:
        return self.depth_sum / self.verifies if self.verifies else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def predicted_gain(self) -> float:
        return self.predicted_gain_sum / self.verifies if self.verifies else 1.0

    def achieved_gain(self) -> float | None:
        """Tokens per second of the verifies over a plain decode step's (measured in
        this request when it ran some, else the engine's one-row pass time)."""
        if not self.verifies or self.spec_seconds <= 0:
            return None
        plain = self.plain_seconds / self.plain_tokens if self.plain_tokens else None
        plain = plain or self.costs.seconds(1)
        if not plain:
            return None
        return (self.spec_tokens / self.spec_seconds) * plain

    def describe(self) -> str:
        """One line for `-v` and `ps`."""
        if self.mode == "off":
            return "speculation off"
        if not self.verifies:
            return f"speculation {self.mode}: no draft was worth verifying"
        achieved = self.achieved_gain()
        gain = "" if achieved is None else f"{achieved:.2f}x the plain decode rate, "
        return (
            f"speculation {self.mode}: {self.verifies} verifies of {self.mean_depth:.1f} "
            f"drafts on average, {self.accepted} of {self.drafted} drafts kept "
            f"({100 * self.accept_rate:.0f}%), {gain}{self.predicted_gain:.2f}x predicted"
        )

    def as_json(self) -> dict[str, str | int | float]:
        """What speculation did, typed as JSON readers want it (STATUS's `speculation`,
        `colibri ps --json`): counts as integers, the mean depth and the gains as numbers
        of two decimals; the mode a word."""
        out: dict[str, str | int | float] = {"spec": self.mode}
        if self.mode == "off":
            return out
        out.update(
            drafted=self.drafted,
            accepted=self.accepted,
            verifies=self.verifies,
            depth=round(self.mean_depth, 2),
            gain_predicted=round(self.predicted_gain, 2),
        )
        achieved = self.achieved_gain()
        if achieved is not None:
            out["gain"] = round(achieved, 2)
        return out

    def extras(self) -> dict[str, str]:
        """The same values as DONE's `key=value` extras (text on the line protocol)."""
        return {
            key: f"{value:.2f}" if isinstance(value, float) else str(value)
            for key, value in self.as_json().items()
        }


@dataclass
class Acceptance:
    """A request's measured rate of accepting the i-th draft after the ones before it.

    The first draft starts from a coin flip (Beta(1, 1)); each deeper one from the rate of
    the one before it, worth PRIOR_TRIES tries: a drafter that is right once tends to be
    right again, and a depth never tried must look as good as that, or it never would be.
    """

    tries: list[int] = field(default_factory=lambda: [0] * (MAX_DEPTH_LIMIT + 1))
    kept: list[int] = field(default_factory=lambda: [0] * (MAX_DEPTH_LIMIT + 1))

    def rate(self, i: int) -> float:
        prior = 0.5 if i <= 1 else self.rate(i - 1)
        return (self.kept[i] + PRIOR_TRIES * prior) / (self.tries[i] + PRIOR_TRIES)

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(1, min(drafted, accepted + 1) + 1):
            self.tries[i] += 1
            self.kept[i] += i <= accepted

    def expected_tokens(self, depth: int) -> float:
        """1 + p1 + p1 p2 + ...: the tokens a verify of `depth` drafts emits on average."""
        total, chain, prior = 1.0, 1.0, 0.5
        for i in range(1, depth + 1):
            rate = (self.kept[i] + PRIOR_TRIES * prior) / (self.tries[i] + PRIOR_TRIES)
            chain *= rate
            total += chain
            prior = rate
        return total


class Drafter(Protocol):
    name: str
    free: bool  # proposing costs nothing: propose first, then choose the depth

    def feed(self, tokens: Sequence[int]) -> None:
        """Tokens now in the context (the prompt, then each emitted token)."""

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` guesses of the tokens after the last one fed."""
        ...

    def cost(self, depth: int) -> float:
        """Seconds drafting `depth` tokens takes (measured; 0 when free)."""
        ...

    def keep_up(self) -> None:
        """Between steps, for a drafter that is not free: stay ready to draft."""


def best_depth(
    acceptance: Acceptance,
    costs: PassCosts,
    others: int,
    available: int,
    draft_cost: Callable[[int], float] = lambda depth: 0.0,
) -> tuple[int, float]:
    """The depth (at most `available`) with the most expected tokens per second of the
    request's share of the pass (its rows on top of `others` rows of other requests) plus
    the drafting, and its expected speed-up over a plain step; (0, 1.0) when nothing
    beats that."""
    base = costs.seconds(others)
    plain = costs.seconds(others + 1)
    if base is None or plain is None or plain - base <= 0:
        return (min(available, 1), 1.0)  # nothing measured yet: one draft, to learn
    plain_rate = 1.0 / (plain - base)
    best, best_rate = 0, plain_rate
    for depth in range(1, available + 1):
        seconds = costs.seconds(others + 1 + depth)
        if seconds is None or seconds - base <= 0:
            continue
        rate = acceptance.expected_tokens(depth) / (seconds - base + draft_cost(depth))
        if rate > best_rate * (1 + 1e-6):
            best, best_rate = depth, rate
    return best, best_rate / plain_rate


class Speculation:
    """One request's speculation: its drafter, acceptance rates, depth choice and stats."""

    def __init__(self, settings: SpecSettings, drafter: Drafter | None, costs: PassCosts):
        self.settings = settings
        self.drafter = drafter
        self.costs = costs
        self.acceptance = Acceptance()
        self.stats = SpecStats(costs, mode=drafter.name if drafter is not None else "off")
        self._idle_steps = 0
        self._draft_s = 0.0  # drafting time of the drafts in flight
        self._context: list[int] = []  # every token fed (for a drafter taking over)
        self._drafting = True  # the last step chose to draft

    def feed(self, tokens: Sequence[int]) -> None:
        """Tokens now in the context (prompt, then each emitted token)."""
        self._context.extend(int(t) for t in tokens)
        if self.drafter is not None:
            self.drafter.feed(tokens)

    def plan(self, room: int) -> list[int]:
        """The drafts for the next pass: at most `room` (what the answer and the context
        still allow), as deep as it is worth beside the rows of the requests sharing it.
        A free drafter proposes first (its proposal's length bounds the depth); one that
        costs a pass per draft (MTP) drafts only as deep as the depth chosen."""
        if self.drafter is None or room <= 0:
            return []
        t0 = time.perf_counter()
        available = min(room, self.settings.max_depth)
        proposal: list[int] | None = None
        self._maybe_fall_back()
        if not self.drafter.free and self._drafting:
            self.drafter.keep_up()  # while it drafts; an idle drafter catches up when asked
        if self.drafter.free:
            proposal = self.drafter.propose(available)
            available = len(proposal)
            if not available:
                return []
        depth, gain = best_depth(
            self.acceptance, self.costs, self.costs.sharing, available, self.drafter.cost
        )
        self._drafting = depth > 0
        if depth == 0:
            self._idle_steps += 1
            if self._idle_steps < EXPLORE_EVERY:
                return []
            depth, gain = 1, 1.0  # keep the first rate measured
        self._idle_steps = 0
        drafts = proposal[:depth] if proposal is not None else self.drafter.propose(depth)
        if drafts:
            self.stats.predicted_gain_sum += gain
            self._draft_s = time.perf_counter() - t0
        return drafts

    def _maybe_fall_back(self) -> None:
        """A drafter that costs passes and is almost never right (an MTP layer of random
        or damaged weights) gives way to prompt lookup, fed what it was fed."""
        a = self.acceptance
        if self.drafter is None or self.drafter.free or a.tries[1] < FALLBACK_TRIES:
            return
        if a.kept[1] / a.tries[1] >= FALLBACK_RATE:
            return
        lookup = PromptLookup()
        lookup.feed(self._context)
        self.drafter = lookup
        self.acceptance = Acceptance()
        self.stats.mode = f"{self.stats.mode}->ngram"

    def verified(self, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        """A verify pass of `drafted` drafts took `seconds` and emitted `emitted` tokens,
        `accepted` of them drafts (the drafting's own time is added here)."""
        st = self.stats
        st.verifies += 1
        st.drafted += drafted
        st.accepted += accepted
        st.depth_sum += drafted
        st.spec_seconds += seconds + self._draft_s
        self._draft_s = 0.0
        st.spec_tokens += emitted
        self.acceptance.observe(drafted, accepted)

    def plain(self, seconds: float) -> None:
        self.stats.plain_seconds += seconds
        self.stats.plain_tokens += 1
