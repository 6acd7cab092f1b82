"""The one tokenizer of a run: the checkpoint's own tokenizer (transformers) and its own chat template.

Why it exists: the engine, the trainer and the driver must turn the same chat into the same token
IDs that the model was trained with. A Hugging Face checkpoint carries that contract itself: its
`tokenizer.json` (the `tokenizers` vocabulary and merges, control tokens as added tokens), its Jinja
chat template (`tokenizer_config.json`'s `chat_template` or `chat_template.jinja`) and the tokens that
end a turn (`generation_config.json`'s `eos_token_id`, as SGLang reads it). There is no second path:
the built-in tiny model is saved in the same layout (lockstep.models.tiny).

`model.chatTemplate` (a Jinja file) replaces the checkpoint's template; everything else comes from
the checkpoint. Rendering is text first (the template), then `encode` without added special tokens,
because templates write their own BOS-like prefixes (`[gMASK]<sop>`).

Who calls it: lockstep.driver (prompts, stop tokens), lockstep.trainer (SFT warm start), the CLI
trainer, lockstep.engine (output text).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files of an HF checkpoint that are not weights or config.json (copied into every saved checkpoint)."""


class ChatTokenizer:
    """A checkpoint's tokenizer with its chat template and stop tokens. Build with `load(dir)`."""

    __slots__ = ("chat_template", "eos_token_id", "hf", "pad_token_id", "source", "stop_token_ids")

    def __init__(
        self, hf: Any, chat_template: str | None, stop_token_ids: Sequence[int], source: str
    ) -> None:
        self.hf = hf
        """The transformers tokenizer (fast: backed by the checkpoint's tokenizer.json)."""
        self.chat_template = chat_template
        """The Jinja chat template prompts are rendered with (None: this tokenizer only encodes/decodes)."""
        self.source = source
        """Where it was loaded from (for error messages)."""
        eos = (
            hf.eos_token_id
            if hf.eos_token_id is not None
            else (stop_token_ids[0] if stop_token_ids else None)
        )
        if eos is None:
            raise ValueError(
                f"{source}: the tokenizer names no eos_token and generation_config.json no eos_token_id; "
                "add eos_token to tokenizer_config.json"
            )
        self.eos_token_id: int = int(eos)
        """The tokenizer's end-of-sequence token."""
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*stop_token_ids, self.eos_token_id]))
        """Tokens that end an assistant turn: generation_config.json's eos_token_id(s), then the
        tokenizer's eos (what SGLang stops on)."""
        pad = hf.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_id
        """Padding token for packing (the eos token when the tokenizer has none, as HF trainers do)."""

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        chat_template: str | os.PathLike[str] | None = None,
        *,
        require_template: bool = True,
    ) -> ChatTokenizer:
        """Load the tokenizer of an HF-layout dir; `chat_template` is a Jinja file replacing its own.

        Raises FileNotFoundError when the dir has no tokenizer and ValueError when it has no chat
        template (unless not `require_template`: an engine only decodes), each naming the fix.
        """
        from transformers import AutoTokenizer

        d = Path(directory)
        if not (d / "tokenizer.json").is_file() and not (d / "tokenizer_config.json").is_file():
            raise FileNotFoundError(
                f"{d}: no tokenizer.json or tokenizer_config.json; point spec.model.tokenizer at the "
                "model's Hugging Face directory (or repo id) that holds them"
            )
        hf = AutoTokenizer.from_pretrained(str(d))
        template = _template(d, hf, chat_template, require_template)
        return cls(hf, template, _generation_eos(d), str(d))

    @property
    def vocab_size(self) -> int:
        """Number of token IDs the tokenizer can produce (added tokens included)."""
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Text -> IDs; control-token strings in the text become their single IDs; no BOS/EOS added.

        Raises ValueError naming the characters a vocabulary without byte fallback cannot represent
        (they would become the unknown token, and the text the model sees would not be the text given).
        """
        ids: list[int] = self.hf.encode(text, add_special_tokens=False)
        unk = self.hf.unk_token_id
        if unk is not None and unk in ids and (self.hf.unk_token or "") not in text:
            bad = sorted({ch for ch in text if self.hf.encode(ch, add_special_tokens=False) == [unk]})
            raise ValueError(
                f"{''.join(bad)!r} (in {text[:40]!r}) is not in the vocabulary of the tokenizer {self.source}; "
                "remove those characters from the prompt data"
            )
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """IDs -> text (control tokens kept unless skip_special_tokens)."""
        text: str = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat template's text of `messages` (OpenAI-style dicts)."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: no chat template; set spec.model.chatTemplate to a Jinja file")
        try:
            text: str = self.hf.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                chat_template=self.chat_template,
            )
        except Exception as e:  # jinja2's TemplateError, raise_exception() inside the template
            raise ValueError(f"chat template of {self.source}: {type(e).__name__}: {e}") from e
        return text

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt IDs of `messages` through the chat template (then `encode`)."""
        return self.encode(self.render_text(messages, add_generation_prompt, tools))

    def reply_pair(
        self,
        messages: Sequence[Mapping[str, Any]],
        reply: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """(prompt IDs with the generation prompt, the IDs of assistant message `reply` after it up to
        its end-of-turn token, exclusive): what a model writes to produce `reply`, through the chat
        template (a reference tool call for an SFT warm start). ValueError when the template is not
        append-only here (the reply's render does not extend the prompt's)."""
        prompt = self.render(messages, True, tools)
        full = self.render([*messages, reply], False, tools)
        if full[: len(prompt)] != prompt:
            raise ValueError(
                f"chat template of {self.source}: rendering an assistant reply changes the prompt before it "
                "(not append-only); a reference reply cannot be imitated with it"
            )
        answer = full[len(prompt) :]
        stops = set(self.stop_token_ids)
        end = next((i for i, t in enumerate(answer) if t in stops), len(answer))
        return prompt, answer[:end]


def _template(d: Path, hf: Any, override: str | os.PathLike[str] | None, required: bool) -> str | None:
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(
                f"spec.model.chatTemplate: {path} is not a file; give a Jinja template file"
            )
        return path.read_text()
    template = hf.chat_template
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    if not isinstance(template, str) or not template.strip():
        if not required:
            return None
        raise ValueError(
            f"{d}: the tokenizer has no chat template (tokenizer_config.json `chat_template` or "
            "chat_template.jinja); add one or set spec.model.chatTemplate to a Jinja file"
        )
    return template


def _generation_eos(d: Path) -> list[int]:
    """generation_config.json's eos_token_id as a list (empty when absent)."""
    path = d / "generation_config.json"
    if not path.is_file():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
