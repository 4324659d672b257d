"""Text <-> token ids for a checkpoint, with its chat template and end-of-sequence ids."""
from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what serving needs around it (EOS ids, chat template)."""

    def __init__(self, backend, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None,
                 chat_template: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.backend = backend
        self.eos_token_ids, self.bos_token_id = tuple(eos_token_ids), bos_token_id
        self.chat_template, self.bos_token, self.eos_token = chat_template, bos_token, eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer | None":
        """The tokenizer saved beside an HF checkpoint (``tokenizer.json``), or None when there is none."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(path / "tokenizer.json"))
        conf = json.loads((path / "tokenizer_config.json").read_text()) if (
            path / "tokenizer_config.json").is_file() else {}
        token = lambda v: v.get("content", "") if isinstance(v, dict) else (v or "")  # noqa: E731
        eos, bos = token(conf.get("eos_token")), token(conf.get("bos_token"))
        ids = lambda s: () if not s or backend.token_to_id(s) is None else (backend.token_to_id(s),)  # noqa: E731
        return cls(backend, ids(eos), (ids(bos) or (None,))[0], conf.get("chat_template"), bos, eos)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render chat ``messages`` with the checkpoint's template, ending with the assistant's turn."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API with a plain prompt")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                          bos_token=self.bos_token, eos_token=self.eos_token)
