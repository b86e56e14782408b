"""A thin wrapper over a Hugging Face `tokenizer.json` (chapter 00).

Text goes in as a string and comes out as token ids; ids come back as text. Streaming adds one
subtlety: a byte-level BPE token can hold part of a UTF-8 character, so decoding tokens one at a
time can produce half a character. `IncrementalDecoder` emits text only once it is complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# The chat template for models whose tokenizer has none (the shipped Shakespeare models): each message
# as a speaker's turn in a play, which is the only dialogue these models have read. The roles become
# the speakers' names, and the prompt ends with the assistant's name, for the model to continue.
CHAT_TEMPLATE = "{ROLE}.\n{content}\n\n"  # per message; then "ASSISTANT.\n"


class Tokenizer:
    """Encode and decode with a `tokenizers` model loaded from a `tokenizer.json` file."""

    def __init__(self, tok: HFTokenizer, bos_token_id: int | None = None, eos_token_ids: list[int] | None = None):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids or [])
        self.chat_template: str | None = None  # the Jinja chat template of tokenizer_config.json, if the model has one

    @classmethod
    def from_file(
        cls, path: str | Path, bos_token_id: int | None = None, eos_token_ids: list[int] | None = None
    ) -> Tokenizer:
        """Load `tokenizer.json`; special-token ids usually come from the model's config. A file the `tokenizers`
        library cannot read is a ValueError naming it."""
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{path} is not a tokenizer.json the `tokenizers` library can read ({exc}): replace it "
                             "with the model's own tokenizer.json.") from exc
        return cls(backend, bos_token_id, eos_token_ids)

    @property
    def backend(self) -> HFTokenizer:
        """The wrapped `tokenizers.Tokenizer`: its vocabulary, decoder and added tokens, for code that needs
        more than encode/decode (constrained decoding reads every token's bytes from it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. `add_special_tokens` applies the tokenizer's template (e.g. a leading BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}; decode bytes with .decode('utf-8') first.")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"the text holds {text[e.start:e.end]!r} at index {e.start}, a lone surrogate that is not a character "
                "and has no UTF-8 bytes; read text files with encoding='utf-8' (errors='replace' if they are damaged)."
            ) from None
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text, dropping special tokens (BOS, EOS, ...) unless asked to keep them."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level tokens show bytes as symbols such as 'Ġ')."""
        return self._tok.id_to_token(token_id)

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json`."""
        self._tok.save(str(path))


def apply_chat_template(messages: list[dict[str, str]], tokenizer: Any) -> str:
    """The prompt for a chat: the model's own chat template (Jinja, from tokenizer_config.json or a GGUF file's
    metadata) if it has one, rendered as transformers renders it with add_generation_prompt, else CHAT_TEMPLATE.

    messages: [{"role": "system" | "user" | "assistant", "content": text}, ...]."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="",
                                                eos_token="")
    text = "".join(CHAT_TEMPLATE.format(ROLE=m["role"].upper(), content=m["content"]) for m in messages)
    return text + "ASSISTANT.\n"


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of complete text pieces.

    Decoding each token alone is wrong twice over: byte-level tokens may split a UTF-8
    character, and some tokenizers change how a token renders depending on its neighbour. So we
    decode a short window of recent tokens and emit only the new suffix, holding it back while it
    ends in the replacement character U+FFFD (an unfinished character).

    Known gap (vLLM's detokenizer has it too): if the *prompt* ids end inside a character, the
    tokens that complete it are not emitted as text. Text prompts always end on whole characters.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids or [])
        # Text before `prefix` is final; `read` marks what has been emitted.
        self.prefix = max(len(self.ids) - 5, 0)
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' if it ends mid-character)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""
