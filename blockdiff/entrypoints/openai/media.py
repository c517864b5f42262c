"""The images of a chat request: URLs fetched in a pool of their own with a total deadline each,
decoded and preprocessed in a bounded decode pool under the request's deadline (docs/images.md).

Fetching waits on the network, decoding takes a core and memory, so neither waits behind the
other: a slow server trickling an image holds one fetch thread for at most the fetch timeout, and
a data: URL (decoded from the body, nothing fetched) never waits for it. Each image's decoded size
is checked from its header before it is decoded (--max-image-decoded-bytes), a request's images
are decoded one after another, and the decode pool has few threads, so the memory that images take
at once is bounded; the heap is trimmed after large ones, as the server otherwise keeps freed memory
(worker/cpu_heap.py).
"""

from __future__ import annotations

from blockdiff.chat_parts import MediaPolicy, fetch_url, split_chat_images
from blockdiff.engine.images import ImageIntake
from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.entrypoints.openai.preprocess import Deadline, WorkPool
from blockdiff.image import ImageError
from blockdiff.worker.cpu_heap import release_freed_memory, resident_bytes

_TRIM_AFTER = 32 * 2**20  # growth of the process while decoding a request's images that trims the heap


class ChatImages:
    def __init__(self, intake: ImageIntake | None, policy: MediaPolicy, decode: WorkPool, fetch: WorkPool):
        """intake: the engine's (its limits, its preprocessing); policy: where image URLs may point."""
        self.intake, self.policy, self.decode, self.fetch = intake, policy, decode, fetch

    async def load(self, messages: list[dict], client: str) -> list:
        """The images of the messages' image_url parts, in order, preprocessed; 400 naming a bad one."""
        intake = self.intake
        try:
            _, urls = split_chat_images(messages, lambda url, what: (url, what))
            intake.check_count(len(urls))  # before anything is fetched
            if not all(isinstance(u, tuple) for u in urls):  # an "image" part's value would be read as a file path
                raise ImageError("this server takes images as image_url parts only")
            sources = [await self._fetch(url, what, client) if _remote(url) else (url, what) for url, what in urls]
            return await self.decode.run(client, self._decode, sources)
        except ImageError as e:
            raise APIError(400, str(e), param="messages", code="invalid_image") from None
        except ValueError as e:  # a part that is neither text nor an image
            raise APIError(400, str(e), param="messages") from None

    async def _fetch(self, url: str, what: str, client: str) -> bytes:
        timeout = self.policy.timeout
        try:
            return await self.fetch.run(client, self._fetch_url, url, what, deadline=Deadline(timeout))
        except APIError:  # the fetch pool's deadline: the thread gives up within one more read
            raise ImageError(f"{what}: the image did not arrive within {timeout:g} s") from None

    def _decode(self, sources: list) -> list:
        """(In the decode pool) data: URLs decoded, then every image, one after another."""
        before = resident_bytes()
        data = [s if isinstance(s, bytes) else self._fetch_url(*s) for s in sources]
        try:
            return self.intake.load(data, "image")
        finally:
            if resident_bytes() - before > _TRIM_AFTER:  # a large image: give back what decoding it took
                release_freed_memory()

    def _fetch_url(self, url: str, what: str) -> bytes:
        return fetch_url(url, self.policy, self.intake.limits.max_bytes, what)


def _remote(url) -> bool:
    """Whether fetching `url` waits on something outside the request (http(s), a file)."""
    return isinstance(url, str) and not url.startswith("data:")
