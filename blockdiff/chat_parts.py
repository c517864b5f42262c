"""Chat messages' content parts in vLLM's / OpenAI's format, and the image and video URLs they
name: the parts rendered for the chat template and split from their media, each URL fetched as its
policy allows. The edge's work, before the engine (which takes images and videos as data): the
server (entrypoints/openai) and the offline API's `LLM.chat` both read chat messages through it.
"""

from __future__ import annotations

import base64
import binascii
import os
import time
import urllib.parse
from dataclasses import dataclass

from blockdiff.config import EngineConfig
from blockdiff.multimodal import MediaError


@dataclass(frozen=True)
class MediaPolicy:
    """Where image and video URLs may point besides data: URLs (vLLM's --allowed-media-domains and
    --allowed-local-media-path); both off by default."""

    domains: tuple[str, ...] = ()
    local_path: str | None = None
    timeout: float = 10.0  # seconds a fetch may take in all (each read gets at most as long)

    @classmethod
    def of(cls, cfg: EngineConfig) -> "MediaPolicy":
        return cls(tuple(d.lower() for d in cfg.allowed_media_domains), cfg.allowed_local_media_path,
                   cfg.media_fetch_timeout)


def fetch_url(url: str, policy: MediaPolicy, max_bytes: int, what: str = "image_url", modality: str = "image") -> bytes:
    """The encoded image or video a URL names, or MediaError saying why not (and how to allow it)."""
    if not isinstance(url, str):
        raise MediaError(f"{what} must be a string URL, not {type(url).__name__}", modality)
    if url.startswith("data:"):
        return _data_url(url, max_bytes, what, modality)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        return _remote(url, policy, max_bytes, what, modality)
    if scheme == "file":
        path = url[len("file://"):] if url.startswith("file://") else url[len("file:"):]
        return _local(path, policy, max_bytes, what, modality)
    raise MediaError(f"{what}: unsupported URL {url[:40]!r}; use a data:{modality}/...;base64 URL"
                     + ("" if policy.domains else ", or enable http(s) URLs with --allowed-media-domains")
                     + ("" if policy.local_path else ", or file:// URLs with --allowed-local-media-path"), modality)


def _data_url(url: str, max_bytes: int, what: str, modality: str) -> bytes:
    head, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise MediaError(f"{what}: a data URL needs a ',' before its data", modality)
    media_type, *options = head.split(";")
    if not media_type.lower().startswith(modality + "/"):
        raise MediaError(f"{what}: a data URL of type {media_type or 'text/plain'!r} is not {_a(modality)}", modality)
    if "base64" not in options:
        raise MediaError(f"{what}: {_a(modality)} data URL must be base64 (data:{media_type};base64,...)", modality)
    if len(payload) * 3 // 4 > max_bytes:
        raise MediaError(f"{what} is about {len(payload) * 3 // 4} bytes, above the limit of {max_bytes}", modality)
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise MediaError(f"{what}: the data URL's base64 data is not valid", modality) from None


def _remote(url: str, policy: MediaPolicy, max_bytes: int, what: str, modality: str) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not policy.domains:
        raise MediaError(f"{what}: fetching media from URLs is off; start the server with "
                         f"--allowed-media-domains {host or 'DOMAIN'} to allow it, or send a data: URL", modality)
    if host not in policy.domains:
        raise MediaError(f"{what}: the domain {host!r} is not in --allowed-media-domains ({', '.join(policy.domains)})",
                         modality)
    import httpx

    end = time.monotonic() + policy.timeout  # a trickle of bytes must not hold the fetch for long
    try:
        with httpx.stream("GET", url, timeout=policy.timeout, follow_redirects=False) as r:
            if r.status_code != 200:
                raise MediaError(f"{what}: {url} answered HTTP {r.status_code}", modality)
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise MediaError(f"{what}: {url} is more than {max_bytes} bytes, the limit", modality)
                if time.monotonic() > end:
                    raise MediaError(f"{what}: {url} did not arrive within {policy.timeout:g} s", modality)
            return bytes(data)
    except httpx.HTTPError as e:
        raise MediaError(f"{what}: cannot fetch {url}: {type(e).__name__}", modality) from None


def _local(path: str, policy: MediaPolicy, max_bytes: int, what: str, modality: str) -> bytes:
    if policy.local_path is None:
        raise MediaError(f"{what}: reading local files is off; start the server with --allowed-local-media-path DIR "
                         "to allow files under DIR", modality)
    # The messages name no path: the client's own says nothing it does not know, the directory
    # allowed is the server's to keep (docs/server.md, "Security").
    root = os.path.realpath(policy.local_path)
    real = os.path.realpath(urllib.parse.unquote(path))
    if os.path.commonpath([root, real]) != root:
        raise MediaError(f"{what}: the file is outside --allowed-local-media-path", modality)
    if not os.path.isfile(real):
        raise MediaError(f"{what}: no such file under --allowed-local-media-path", modality)
    if os.path.getsize(real) > max_bytes:
        raise MediaError(f"{what}: the file is {os.path.getsize(real)} bytes, above the limit of {max_bytes}", modality)
    with open(real, "rb") as f:
        return f.read()


IMAGE_PART_TYPES = ("image_url", "image", "image_pil")
VIDEO_PART_TYPES = ("video_url", "video")
# A content part's type -> the modality of what it holds
PART_MODALITY = {**{k: "image" for k in IMAGE_PART_TYPES}, **{k: "video" for k in VIDEO_PART_TYPES}}


def _a(modality: str) -> str:
    return f"an {modality}" if modality[0] in "aeiou" else f"a {modality}"


def split_chat_media(messages: list[dict], fetch) -> tuple[list[dict], dict[str, list]]:
    """Messages in vLLM's / OpenAI's format -> (the messages for the chat template, content as
    `template_content` gives it; per modality its inputs in order). `fetch(url, what, modality)`
    turns a URL into bytes."""
    rendered, media = [], {}
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        rendered.append({**message, "content": template_content(i, content)})
        for j, part in enumerate(content):
            kind = part["type"]
            modality = PART_MODALITY.get(kind)
            if modality is None:
                continue
            what = f"messages[{i}].content[{j}]"
            value = part.get(kind)
            if kind.endswith("_url"):
                url = value.get("url") if isinstance(value, dict) else value
                media.setdefault(modality, []).append(fetch(url, what, modality))
            elif value is None:
                raise MediaError(f"{what}: a {kind!r} part needs its {kind!r} field", modality)
            else:
                media.setdefault(modality, []).append(value)
    return rendered, media


def template_content(i: int, parts: list) -> str | list[dict]:
    """Message i's content parts as the chat template reads them. Without images, the text parts
    joined into one string, as vLLM gives them to templates that read strings (a template that loops
    over parts would otherwise be the only kind to see them); with images or videos, the text parts
    as they are and each image as {"type": "image"}, each video as {"type": "video"}. Any other part
    is a ValueError naming it."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in PART_MODALITY:
            out.append({"type": PART_MODALITY[kind]})
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "text":
            raise ValueError(f"messages[{i}].content[{j}]: a 'text' part needs a string 'text' field")
        else:
            raise ValueError(f"messages[{i}].content[{j}]: {kind!r} parts are not supported; this model reads text, "
                             "images and videos")
    if any(part["type"] != "text" for part in out):
        return out
    return "".join(part["text"] for part in out)
