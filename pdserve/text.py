"""Streaming text of one request: incremental detokenization and stop strings."""

from __future__ import annotations

from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """Detokenizes one request and applies its stop strings (the text ends before the stop string).

    Text that might still turn out to be the start of a stop string is held back until it cannot be.
    """

    def __init__(
        self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: tuple[str, ...]
    ) -> None:
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        )
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, token_id: int) -> bool:
        """Append a token; True if a stop string completed."""
        if self.detok is None:
            return False
        self.text += self.detok.step(token_id)
        for s in self.stop:
            # Only the newly added tail (plus overlap) can contain a new match.
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                return True
        return False

    def flush(self) -> None:
        """At the end: text held back for an incomplete character."""
        if self.detok is not None:
            self.text += self.detok.flush()

    def take(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
