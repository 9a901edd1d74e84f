"""Stop strings over streamed text: the text before the first stop string, found across chunk
boundaries, with nothing of the stop string itself ever sent.

Text arrives in pieces (one per accepted step). A piece's tail that could still grow into a stop
string is held back until the next piece says whether it does; at the end of the answer the held
text is released (``flush``).
"""

from __future__ import annotations

MAX_STOPS = 4  # as OpenAI's API


class StopStrings:
    """Feed text with :meth:`push`; it returns what can be sent now. :attr:`matched` turns True at
    the first stop string, after which nothing more is returned."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched = False

    def push(self, piece: str) -> str:
        if self.matched:
            return ""
        if not self.stops:
            return piece
        text = self.held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.matched, self.held = True, ""
            return text[:cut]
        keep = self._held_back(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text at the end of the answer (no stop string completed it)."""
        rest, self.held = ("" if self.matched else self.held), ""
        return rest

    def _held_back(self, text: str) -> int:
        """The length of ``text``'s longest tail that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - n:]):
                    longest = n
                    break
        return longest
