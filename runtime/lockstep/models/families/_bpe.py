"""Offline tokenizers for the families whose real vocabularies we cannot download here.

Why it exists: the TITO tests need a tokenizer with the family's control tokens as single IDs and
an ordinary byte-level BPE for text, so that re-tokenizing sampled text really can differ from the
sampled IDs (the failure TITO exists to prevent). We train a small byte-level BPE with the
`tokenizers` library on a fixed in-code corpus: deterministic, built in milliseconds, no download.
It is a stand-in with the real family's control tokens and seams, not the real vocabulary.

A deployment serving the real model passes its checkpoint dir instead (`from_dir`), and the same
family module then speaks the real vocabulary.

Who calls it: lockstep.models.families.qwen3 and glm47.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = (
    "The assistant calls the calc tool, reads the result and answers the user. "
    "What is 12 * 7? Let me compute that with the calculator. The answer is 84. "
    '{"name": "calc", "arguments": {"expression": "12 * 7"}} {"result": 84} '
    "Thinking step by step: first multiply, then add, finally check the result. "
    "user assistant system tool observation think tool_call tool_response arg_key arg_value "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } : , . ? ! \n \n\n  "
)


def _id(tok: Tokenizer, token: str, source: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise ValueError(
            f"{source}: control token {token!r} is not in this vocabulary; is it the right family?"
        )
    return int(tid)


class BpeCodec:
    """A `tokenizers.Tokenizer` plus the family's control tokens as single IDs.

    `BpeCodec.stand_in(specials)` trains the offline stand-in; `BpeCodec.from_dir(path, specials)`
    loads a real model's tokenizer.json (what a deployment serving the real Qwen3 or GLM-4.7 uses,
    so the session server's IDs are the engine's IDs).
    """

    def __init__(self, tokenizer: Tokenizer, specials: Sequence[str], source: str) -> None:
        self.tokenizer = tokenizer
        """The tokenizer (control tokens are single added tokens)."""
        self.source = source
        """Where it came from: "stand-in" or the tokenizer.json path (for error messages)."""
        self.special_to_id: dict[str, int] = {s: _id(tokenizer, s, source) for s in specials}
        """Control-token string -> ID."""
        self._special_ids = frozenset(self.special_to_id.values())
        unk = getattr(tokenizer.model, "unk_token", None)
        unk_id = tokenizer.token_to_id(unk) if unk else None
        self._unk: tuple[str, int] | None = (unk, int(unk_id)) if unk and unk_id is not None else None

    @classmethod
    def stand_in(cls, specials: Sequence[str], vocab_size: int = 512) -> BpeCodec:
        """Train the deterministic offline stand-in on the in-code corpus."""
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
        return cls(tok, specials, "stand-in")

    @classmethod
    def from_dir(cls, directory: str | Path, specials: Sequence[str]) -> BpeCodec:
        """Load `directory`/tokenizer.json; every control token of the family must be in it."""
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: pass the model's checkpoint dir (it holds tokenizer.json)"
            )
        return cls(Tokenizer.from_file(str(path)), specials, str(path))

    @classmethod
    def load(cls, tokenizer_dir: str | Path | None, specials: Sequence[str]) -> BpeCodec:
        """The served model's tokenizer from `tokenizer_dir`, or the offline stand-in when None."""
        return cls.from_dir(tokenizer_dir, specials) if tokenizer_dir else cls.stand_in(specials)

    def encode(self, text: str) -> list[int]:
        """Token IDs of `text`; ValueError naming the characters a vocabulary without byte fallback
        (the tiny one) cannot represent, instead of a silent unknown token."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if self._unk is not None and self._unk[1] in ids and self._unk[0] not in text:
            bad = sorted(
                {
                    ch
                    for ch in text
                    if self.tokenizer.encode(ch, add_special_tokens=False).ids == [self._unk[1]]
                }
            )
            raise ValueError(f"{''.join(bad)!r} is not in the vocabulary of {self.source}")
        return ids

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
