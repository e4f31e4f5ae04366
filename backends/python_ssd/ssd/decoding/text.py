"""Text <-> tokens for the orchestrator, without transformers.

The Python backend stub embeds its own libpython; importing transformers there pulls in `ssl`,
whose extension module does not load against the stub's interpreter. The `tokenizers` library and
jinja2 (for the chat template, rendered the way transformers renders it) are enough.
"""
from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..engine.meta import engine_meta


class TextCodec:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        tpl_path = folder / "chat_template.jinja"
        template = tpl_path.read_text() if tpl_path.exists() else cfg.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(template) if isinstance(template, str) else None
        self.bos_token = cfg.get("bos_token") if isinstance(cfg.get("bos_token"), str) else None
        self.eos_token = cfg.get("eos_token") if isinstance(cfg.get("eos_token"), str) else None
        eos = set(engine_meta(folder).get("eos_token_ids", []))
        if self.eos_token and self.tokenizer.token_to_id(self.eos_token) is not None:
            eos.add(self.tokenizer.token_to_id(self.eos_token))
        self.eos_ids = eos

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        if chat and self.template is not None:
            rendered = self.template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True,
                                            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
            return self.tokenizer.encode(rendered, add_special_tokens=False).ids
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
