"""The images and videos of a prompt: counted against the limits, loaded by their modality's
processor (blockdiff/multimodal: checked, decoded, preprocessed), and their placeholders in the
prompt expanded. Which processors there are is the architecture's (model/registry.py); nothing
here knows one modality from another. The engine takes inputs as data (PIL images, encoded bytes,
file paths); URLs and chat messages' content parts are the edge's (blockdiff/chat_parts.py)."""

from __future__ import annotations

from blockdiff.config import EngineConfig, ModelConfig
from blockdiff.inputs import PromptInputs
from blockdiff.model.registry import architecture_of
from blockdiff.multimodal import MediaError, MultiModalItem, Processor, expand_placeholders, expand_text

MODALITIES = ("image", "video")  # what vLLM's multi_modal_data and --limit-mm-per-prompt name


class MultiModalIntake:
    def __init__(self, processors: dict[str, Processor | str], token_text=None):
        """processors: per modality its processor, or what the checkpoint lacks to take it.
        token_text: token id -> its text (the tokenizer's), for text prompts."""
        self.processors = processors
        self.token_text = token_text

    @classmethod
    def from_pretrained(cls, cfg: EngineConfig, config: ModelConfig, tokenizer) -> "MultiModalIntake":
        return cls({m: make(cfg, config, tokenizer) for m, make in architecture_of(config).processors.items()},
                   tokenizer.id_to_token if tokenizer is not None else None)

    def processor(self, modality: str) -> Processor | None:
        p = self.processors.get(modality)
        return None if p is None or isinstance(p, str) else p

    @property
    def placeholders(self) -> dict[str, int]:
        return {m: p.placeholder for m in self.processors if (p := self.processor(m)) is not None}

    def check_counts(self, counts: dict[str, int]) -> None:
        """MediaError unless a prompt may hold `counts` inputs of each modality; called before any
        of them is decoded."""
        for m, n in counts.items():
            if not n:
                continue
            p = self.processors.get(m)
            if p is None or isinstance(p, str):
                raise MediaError(f"this model does not take {m}s" + (f": its checkpoint has {p}" if p else ""), m)
            if n > p.limit:
                raise MediaError(f"{n} {m}s in one prompt, above the limit of {p.limit} (--limit-mm-per-prompt)", m)

    def load(self, sources: dict[str, list]) -> list[MultiModalItem]:
        """Per modality its inputs (as its processor takes them) -> the items, modality by modality."""
        self.check_counts({m: len(s) for m, s in sources.items()})
        return [self.processor(m).load(s, f"{m} {i}") for m, given in sources.items() for i, s in enumerate(given)]

    def expand(self, ids: list[int], items: list[MultiModalItem]) -> PromptInputs:
        ids, placeholders = expand_placeholders(ids, items, self.placeholders)
        return PromptInputs(ids, items, placeholders)

    def expand_text(self, text: str, items: list[MultiModalItem], encode) -> PromptInputs:
        """A text prompt expanded as transformers' processor expands it: as text, then tokenized by
        `encode`; by its ids where the items have no text (no tokenizer)."""
        if self.token_text is None or any(item.text is None for item in items):
            return self.expand(encode(text), items)
        placeholders = {m: (self.token_text(t), t) for m, t in self.placeholders.items()}
        ids, runs = expand_text(text, items, placeholders, encode)
        return PromptInputs(ids, items, runs)


def split_prompt(prompt) -> tuple[str | list[int], dict[str, list] | None]:
    """A prompt in vLLM's dict form ({"prompt": text or "prompt_token_ids": ids, "multi_modal_data":
    {"image": one or a list, "video": one or a list}}) -> (text or ids, inputs per modality); any
    other prompt -> (it, None)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids', and 'multi_modal_data'; got {sorted(prompt)}")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - set(MODALITIES):
        raise ValueError(f"multi_modal_data takes {' and '.join(map(repr, MODALITIES))}, got {data!r:.80}")
    sources = {}
    for m, given in data.items():
        if given is not None:
            sources[m] = list(given) if isinstance(given, (list, tuple)) else [given]
    return prompt.get("prompt", prompt.get("prompt_token_ids")), sources
