"""Where a model argument points: the bundled demo checkpoint (none given), a local directory, or a
Hugging Face Hub id (`org/name`) found in the local Hugging Face cache."""

from __future__ import annotations

import os

_DOWNLOAD_HINT = "download it first with `hf download {repo}{dir_flag}`"
# The bundled demo model's checkpoint (blockdiff/demo/, `blockdiff train-demo`): the default model.
DEMO_NAME = "demo"
DEMO_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "checkpoint")


def demo_checkpoint() -> str:
    """The bundled demo checkpoint's directory."""
    if not os.path.isfile(os.path.join(DEMO_CHECKPOINT, "model.safetensors")):
        raise FileNotFoundError(
            f"the demo checkpoint is missing from {DEMO_CHECKPOINT}; recreate it with `blockdiff train-demo`"
        )
    return DEMO_CHECKPOINT


def resolve_model(model: str | None, download_dir: str | None = None, what: str = "model") -> str:
    """-> a checkpoint directory: None or "demo" is the bundled demo checkpoint. Hub ids are looked up in the cache only (`download_dir`, else
    HF_HUB_CACHE, else HF_HOME/hub): a server must not stall on a multi-GB download at startup.
    Raises ValueError for what is neither a directory nor a cached hub id, saying how to get it;
    `what` names the argument in it."""
    if os.path.isdir(model or "") or (os.path.isfile(model or "") and model.endswith(".json")):  # a config alone: dummy weights
        return model
    if model is None or model == DEMO_NAME:  # the demo's served name names it too (a directory of that name wins)
        return demo_checkpoint()
    if not _looks_like_repo_id(model):
        raise ValueError(f"{what} {model!r} is not a checkpoint directory, nor a Hugging Face id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(model, cache_dir=download_dir, local_files_only=True)
    except LocalEntryNotFoundError:
        hint = _DOWNLOAD_HINT.format(repo=model, dir_flag=f" --cache-dir {download_dir}" if download_dir else "")
        raise ValueError(f"{what} {model!r} is not a local directory and not in the Hugging Face cache "
                         f"({download_dir or _default_cache()}); {hint}") from None


def resolve_tokenizer(tokenizer: str, download_dir: str | None = None) -> str:
    """-> the directory of a tokenizer given apart from the model: as resolve_model finds it, and
    holding the tokenizer.json that blockdiff reads."""
    path = resolve_model(tokenizer, download_dir, what="tokenizer")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"tokenizer {tokenizer!r} has no tokenizer.json")
    return path


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def _default_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
