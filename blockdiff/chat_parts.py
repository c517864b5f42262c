"""Chat messages' content parts in vLLM's / OpenAI's format, and the image URLs they name: the
parts rendered for the chat template and split from their images, each URL fetched as its policy
allows. The edge's work, before the engine (which takes images as data): the server
(entrypoints/openai) and the offline API's `LLM.chat` both read chat messages through it.
"""

from __future__ import annotations

import base64
import binascii
import os
import time
import urllib.parse
from dataclasses import dataclass

from blockdiff.config import EngineConfig
from blockdiff.image import ImageError


@dataclass(frozen=True)
class MediaPolicy:
    """Where image URLs may point besides data: URLs (vLLM's --allowed-media-domains and
    --allowed-local-media-path); both off by default."""

    domains: tuple[str, ...] = ()
    local_path: str | None = None
    timeout: float = 10.0  # seconds a fetch may take in all (each read gets at most as long)

    @classmethod
    def of(cls, cfg: EngineConfig) -> "MediaPolicy":
        return cls(tuple(d.lower() for d in cfg.allowed_media_domains), cfg.allowed_local_media_path,
                   cfg.media_fetch_timeout)


def fetch_url(url: str, policy: MediaPolicy, max_bytes: int, what: str = "image_url") -> bytes:
    """The encoded image an image URL names, or ImageError saying why not (and how to allow it)."""
    if not isinstance(url, str):
        raise ImageError(f"{what} must be a string URL, not {type(url).__name__}")
    if url.startswith("data:"):
        return _data_url(url, max_bytes, what)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        return _remote(url, policy, max_bytes, what)
    if scheme == "file":
        return _local(url[len("file://"):] if url.startswith("file://") else url[len("file:"):], policy, max_bytes, what)
    raise ImageError(f"{what}: unsupported URL {url[:40]!r}; use a data:image/...;base64 URL"
                     + ("" if policy.domains else ", or enable http(s) URLs with --allowed-media-domains")
                     + ("" if policy.local_path else ", or file:// URLs with --allowed-local-media-path"))


def _data_url(url: str, max_bytes: int, what: str) -> bytes:
    head, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise ImageError(f"{what}: a data URL needs a ',' before its data")
    media_type, *options = head.split(";")
    if not media_type.lower().startswith("image/"):
        raise ImageError(f"{what}: a data URL of type {media_type or 'text/plain'!r} is not an image")
    if "base64" not in options:
        raise ImageError(f"{what}: an image data URL must be base64 (data:{media_type};base64,...)")
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageError(f"{what} is about {len(payload) * 3 // 4} bytes, above the limit of {max_bytes}")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise ImageError(f"{what}: the data URL's base64 data is not valid") from None


def _remote(url: str, policy: MediaPolicy, max_bytes: int, what: str) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not policy.domains:
        raise ImageError(f"{what}: fetching images from URLs is off; start the server with "
                         f"--allowed-media-domains {host or 'DOMAIN'} to allow it, or send a data:image/...;base64 URL")
    if host not in policy.domains:
        raise ImageError(f"{what}: the domain {host!r} is not in --allowed-media-domains ({', '.join(policy.domains)})")
    import httpx

    end = time.monotonic() + policy.timeout  # a trickle of bytes must not hold the fetch for long
    try:
        with httpx.stream("GET", url, timeout=policy.timeout, follow_redirects=False) as r:
            if r.status_code != 200:
                raise ImageError(f"{what}: {url} answered HTTP {r.status_code}")
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise ImageError(f"{what}: {url} is more than {max_bytes} bytes, the limit")
                if time.monotonic() > end:
                    raise ImageError(f"{what}: {url} did not arrive within {policy.timeout:g} s")
            return bytes(data)
    except httpx.HTTPError as e:
        raise ImageError(f"{what}: cannot fetch {url}: {type(e).__name__}") from None


def _local(path: str, policy: MediaPolicy, max_bytes: int, what: str) -> bytes:
    if policy.local_path is None:
        raise ImageError(f"{what}: reading local files is off; start the server with --allowed-local-media-path DIR "
                         "to allow files under DIR")
    # The messages name no path: the client's own says nothing it does not know, the directory
    # allowed is the server's to keep (docs/server.md, "Security").
    root = os.path.realpath(policy.local_path)
    real = os.path.realpath(urllib.parse.unquote(path))
    if os.path.commonpath([root, real]) != root:
        raise ImageError(f"{what}: the file is outside --allowed-local-media-path")
    if not os.path.isfile(real):
        raise ImageError(f"{what}: no such file under --allowed-local-media-path")
    if os.path.getsize(real) > max_bytes:
        raise ImageError(f"{what}: the file is {os.path.getsize(real)} bytes, above the limit of {max_bytes}")
    with open(real, "rb") as f:
        return f.read()


IMAGE_PART_TYPES = ("image_url", "image", "image_pil")


def split_chat_images(messages: list[dict], fetch) -> tuple[list[dict], list]:
    """Messages in vLLM's / OpenAI's format -> (the messages for the chat template, content as
    `template_content` gives it; the images in order). `fetch(url, what)` turns an image URL into bytes."""
    rendered, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        rendered.append({**message, "content": template_content(i, content)})
        for j, part in enumerate(content):
            kind = part["type"]
            if kind not in IMAGE_PART_TYPES:
                continue
            what = f"messages[{i}].content[{j}]"
            value = part.get(kind)
            if kind == "image_url":
                url = value.get("url") if isinstance(value, dict) else value
                images.append(fetch(url, what))
            elif value is None:
                raise ImageError(f"{what}: an {kind!r} part needs its {kind!r} field")
            else:
                images.append(value)
    return rendered, images


def template_content(i: int, parts: list) -> str | list[dict]:
    """Message i's content parts as the chat template reads them. Without images, the text parts
    joined into one string, as vLLM gives them to templates that read strings (a template that loops
    over parts would otherwise be the only kind to see them); with images, the text parts as they
    are and each image as {"type": "image"}. Any other part is a ValueError naming it."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in IMAGE_PART_TYPES:
            out.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "text":
            raise ValueError(f"messages[{i}].content[{j}]: a 'text' part needs a string 'text' field")
        else:
            raise ValueError(f"messages[{i}].content[{j}]: {kind!r} parts are not supported; this model reads text and images")
    if any(part["type"] == "image" for part in out):
        return out
    return "".join(part["text"] for part in out)
