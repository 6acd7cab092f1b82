"""Offline tokenizers for the families whose real vocabularies we cannot download here.

Why it exists: the TITO tests need a tokenizer with the family's control tokens as single IDs and
an ordinary byte-level BPE for text, so that re-tokenizing sampled text really can differ from the
sampled IDs (the failure TITO exists to prevent). We train a small byte-level BPE with the
`tokenizers` library on a fixed in-code corpus: deterministic, built in milliseconds, no download.
It is a stand-in with the real family's control tokens and seams, not the real vocabulary.

Who calls it: lockstep.models.families.qwen3 and glm47.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = (
    "The assistant calls the calc tool, reads the result and answers the user. "
    "What is 12 * 7? Let me compute that with the calculator. The answer is 84. "
    '{"name": "calc", "arguments": {"expression": "12 * 7"}} {"result": 84} '
    "Thinking step by step: first multiply, then add, finally check the result. "
    "user assistant system tool observation think tool_call tool_response arg_key arg_value "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } : , . ? ! \n \n\n  "
)


def _id(tok: Tokenizer, token: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise KeyError(f"control token {token!r} is missing from the trained vocabulary")
    return int(tid)


class BpeCodec:
    """A byte-level BPE `tokenizers.Tokenizer` plus the family's control tokens as single IDs."""

    def __init__(self, specials: Sequence[str], vocab_size: int = 512) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([_CORPUS] * 4, trainer)
        self.tokenizer = tok
        """The trained tokenizer (control tokens are its added special tokens, IDs 0..n-1)."""
        self.special_to_id: dict[str, int] = {s: _id(tok, s) for s in specials}
        """Control-token string -> ID."""
        self._special_ids = frozenset(self.special_to_id.values())

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        # Decode runs between control tokens separately: the byte-level decoder would otherwise
        # glue an added token's text to its neighbours unchanged anyway, but this keeps it explicit.
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def id(self, token: str) -> int:
        """The ID of a control token (KeyError names the token when it is not one)."""
        return self.special_to_id[token]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())
