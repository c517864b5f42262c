"""A request's output, grown one committed canvas at a time: its tokens, text and logprobs, and
the stop rules that end it.

Work per canvas depends on the canvas, not on the output so far: only the new tokens are decoded
(with a few tokens of context, as vLLM's incremental detokenizer does), and stop strings are
searched in the new text plus the last `len(longest stop) - 1` characters before it. Text that
may still change stays pending: trailing bytes of an incomplete UTF-8 character, and the tail a
stop string finishing in the next canvas could cut.
"""

from __future__ import annotations

from blockdiff.outputs import TokenLogprob
from blockdiff.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, max_tokens: int, stop_token_ids: set[int], stop: list[str] | None,
                 want_logprobs: bool, skip_special_tokens: bool = True, min_tokens: int = 0, include_stop: bool = False):
        """min_tokens: no stop token or stop string ends the output before this many tokens.
        include_stop: the stop string, or the stop token's text, stays at the end of the text (vLLM's
        include_stop_str_in_output)."""
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.stop = stop or []
        self.holdback = max(map(len, self.stop)) - 1 if self.stop else 0
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if want_logprobs else None
        self.pieces: list[str] = []  # final text, never cut again
        self.pending = ""  # decoded text that a stop string may still cut
        self._prefix = 0  # token offsets: where the decoded context starts...
        self._read = 0  # ...and the first token whose text is in neither `pieces` nor `pending`
        self.ends_with_stop_token = False  # a stop or EOS token ends the output; its text is left out
        self.stop_reason: str | int | None = None  # the stop string or token id that ended the output

    def append(self, canvas: list[int], logprobs: list[TokenLogprob] | None = None) -> str | None:
        """Add a committed canvas; -> "length", "stop", or None to go on. Trims the output at the
        first stop condition and flushes all text once it ends."""
        reason = None
        room = self.max_tokens - len(self.token_ids)
        if len(canvas) >= room:
            canvas, reason = canvas[:room], "length"
        start = len(self.token_ids)
        early = max(0, self.min_tokens - start)  # positions of this canvas where nothing may stop the output
        cut = next((i for i, t in enumerate(canvas) if i >= early and t in self.stop_token_ids), None)
        if cut is not None:
            # As in vLLM, a stop token stays in token_ids but its text is left out of the output text.
            canvas, reason, self.ends_with_stop_token = canvas[: cut + 1], "stop", True
            self.stop_reason = canvas[cut]
        self.token_ids.extend(canvas)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(self.with_texts(logprobs[: len(canvas)]))
        if self.tokenizer is None:
            return reason
        text_end = len(self.token_ids) - (1 if self.ends_with_stop_token and not self.include_stop else 0)
        context = self._decode(self._prefix, self._read)
        end = text_end
        if reason is None:  # an incomplete character at the end waits for the next canvas
            while end > self._read and self._decode(self._prefix, end).endswith("\ufffd"):
                end -= 1
        delta = self._decode(self._prefix, end)[len(context):]
        window = self.pending + delta
        # A stop string must end after the text of the first min_tokens tokens.
        after = 0 if early == 0 else len(self.pending) + len(self._decode(self._prefix, min(self.min_tokens, end))) - len(context)
        hit = self._first_stop(window, after)
        if hit is not None:
            stop_start, stop_end = hit
            kept = self._tokens_reaching(start, stop_end - len(self.pending), context)
            del self.token_ids[kept:]
            if self.logprobs is not None:
                del self.logprobs[kept:]
            self.ends_with_stop_token = False
            self.stop_reason = window[stop_start:stop_end]
            self.pieces.append(window[:stop_end if self.include_stop else stop_start])
            self.pending = ""
            return "stop"
        self._prefix, self._read = self._read, end
        keep = 0 if reason is not None else min(self.holdback, len(window))
        self.pieces.append(window[: len(window) - keep])
        self.pending = window[len(window) - keep :]
        return reason

    def with_texts(self, logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
        """`logprobs` with each token's and alternative's text (vLLM's Logprob.decoded_token: the
        token decoded alone, special tokens included, as the server shows it); as they are without
        a tokenizer."""
        if self.tokenizer is not None:
            for lp in logprobs:
                lp.texts = {t: self.tokenizer.decode([t], skip_special_tokens=False) for t in (lp.token_id, *lp.top)}
        return logprobs

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], self.skip_special_tokens)

    def _first_stop(self, window: str, after: int = 0) -> tuple[int, int] | None:
        """(start, end) in `window` of the stop string that ends first, past character `after`."""
        best = None
        for s in self.stop:
            i = window.find(s, max(0, after - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[1]):
                best = (i, i + len(s))
        return best

    def _tokens_reaching(self, first_new: int, chars: int, context: str) -> int:
        """The fewest output tokens whose new text covers `chars` characters (the stop string ends
        in this canvas, so some token from `first_new` on reaches it): a binary search."""
        lo, hi = max(first_new, self._read) + 1, len(self.token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(self._prefix, mid)) - len(context) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    @property
    def text(self) -> str:
        """All final text (the pending tail excluded until the output ends)."""
        return "".join(self.pieces)
