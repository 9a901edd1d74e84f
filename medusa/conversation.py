"""A multi-turn conversation as the exact token ids a model has seen and produced.

The chat uses it; API users reach the same token-exact prompts and context fitting:

>>> conv = Conversation(engine.tokenizer, system="Be brief.")
>>> prompt = conv.fit("Name three rivers.", window=engine.max_positions, budget=256)
>>> res = engine.generate(prompt.ids, max_new_tokens=256, state=state)
>>> conv.add("Name three rivers.", prompt, res.tokens, res.finish_reason, res.stats.as_dict())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from medusa.errors import MedusaError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Turn:
    user: str
    answer: str
    prompt_ids: list[int]  # everything the model saw before answering
    answer_ids: list[int]  # what it answered (end-of-turn token included when it ended)
    finish_reason: str
    stats: dict[str, Any]


@dataclass
class Prompt:
    ids: list[int]
    text: str  # the chat-template text the ids stand for
    dropped: int  # oldest turns left out to fit the context window


@dataclass
class Conversation:
    """Messages plus the exact token ids the model has seen and produced so far.

    A new turn's ids are the previous ids as they were generated (exactly what the KV cache
    holds) followed by the template's continuation, encoded; re-encoding the whole history
    would be equal in text but may split the model's own answers into different tokens.
    """

    tokenizer: PreTrainedTokenizerBase
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""

    def messages(self, turns: list[Turn], user: str | None) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system is not None else []
        for t in turns:
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.answer}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, user: str, turns: list[Turn]) -> Prompt:
        text = self.tokenizer.apply_chat_template(self.messages(turns, user), add_generation_prompt=True, tokenize=False)
        if self.text and text.startswith(self.text):
            return Prompt(self.ids + self.encode(text[len(self.text):]), text, len(self.turns) - len(turns))
        return Prompt(self.encode(text), text, len(self.turns) - len(turns))

    def fit(self, user: str, window: int, budget: int) -> Prompt:
        """The prompt for ``user``'s message, oldest turns dropped until the prompt plus an
        answer of ``budget`` tokens fits a ``window``-token context."""
        turns = list(self.turns)
        while True:
            prompt = self.prompt(user, turns)
            if len(prompt.ids) + budget <= window:
                return prompt
            if not turns:
                raise MedusaError(
                    f"the message needs {len(prompt.ids)} tokens but only {window - budget} fit "
                    f"(context window {window} less {budget} for the answer): shorten it or lower --max-new-tokens"
                )
            turns = turns[1:]

    def add(self, user: str, prompt: Prompt, answer_ids: list[int], finish_reason: str, stats: dict[str, Any]) -> None:
        decode = self.tokenizer.decode
        answer = decode(answer_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        self.turns = self.turns[prompt.dropped:] + [Turn(user, answer, prompt.ids, list(answer_ids), finish_reason, stats)]
        self.ids = prompt.ids + list(answer_ids)
        self.text = prompt.text + decode(answer_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def reset(self) -> None:
        self.turns, self.ids, self.text = [], [], ""
