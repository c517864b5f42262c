"""The images and videos of a chat request: URLs fetched in a pool of their own with a total
deadline each, decoded and preprocessed in a bounded decode pool under the request's deadline
(docs/images.md, docs/video.md).

Fetching waits on the network, decoding takes a core and memory, so neither waits behind the
other: a slow server trickling a file holds one fetch thread for at most the fetch timeout, and
a data: URL (decoded from the body, nothing fetched) never waits for it. Each input's decoded size
is checked from its header before it is decoded (--max-image-decoded-bytes,
--max-video-decoded-bytes, --max-video-frames), a request's inputs are decoded one after another,
and the decode pool has few threads, so the memory that they take at once is bounded; the heap is
trimmed after large ones, as the server otherwise keeps freed memory (worker/cpu_heap.py).
"""

from __future__ import annotations

from blockdiff.chat_parts import MediaPolicy, fetch_url, split_chat_media
from blockdiff.engine.multimodal import MultiModalIntake
from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.entrypoints.openai.work_pool import Deadline, WorkPool
from blockdiff.multimodal import MediaError
from blockdiff.worker.cpu_heap import release_freed_memory, resident_bytes

_TRIM_AFTER = 32 * 2**20  # growth of the process while decoding a request's inputs that trims the heap


class ChatMedia:
    def __init__(self, intake: MultiModalIntake, policy: MediaPolicy, decode: WorkPool, fetch: WorkPool):
        """intake: the engine's (its limits, its processors); policy: where URLs may point."""
        self.intake, self.policy, self.decode, self.fetch = intake, policy, decode, fetch

    async def load(self, messages: list[dict], client: str) -> list:
        """The items of the messages' image_url and video_url parts, in order, preprocessed; 400
        naming a bad one."""
        intake = self.intake
        try:
            _, urls = split_chat_media(messages, lambda url, what, modality: (url, what, modality))
            intake.check_counts({m: len(u) for m, u in urls.items()})  # before anything is fetched
            if not all(isinstance(u, tuple) for given in urls.values() for u in given):
                # an "image" or "video" part's value would be read as a file path
                raise MediaError("this server takes images and videos as image_url and video_url parts only")
            sources = {m: [await self._fetch(*u, client) if _remote(u[0]) else u for u in given]
                       for m, given in urls.items()}
            return await self.decode.run(client, self._decode, sources)
        except MediaError as e:
            raise APIError(400, str(e), param="messages", code=e.code) from None
        except ValueError as e:  # a part that is neither text nor an image or a video
            raise APIError(400, str(e), param="messages") from None

    async def _fetch(self, url: str, what: str, modality: str, client: str) -> bytes:
        timeout = self.policy.timeout
        try:
            return await self.fetch.run(client, self._fetch_url, url, what, modality, deadline=Deadline(timeout))
        except APIError:  # the fetch pool's deadline: the thread gives up within one more read
            raise MediaError(f"{what}: the {modality} did not arrive within {timeout:g} s", modality) from None

    def _decode(self, sources: dict[str, list]) -> list:
        """(In the decode pool) data: URLs decoded, then every input, one after another."""
        before = resident_bytes()
        data = {m: [s if isinstance(s, bytes) else self._fetch_url(*s) for s in given] for m, given in sources.items()}
        try:
            return self.intake.load(data)
        finally:
            if resident_bytes() - before > _TRIM_AFTER:  # a large input: give back what decoding it took
                release_freed_memory()

    def _fetch_url(self, url: str, what: str, modality: str) -> bytes:
        return fetch_url(url, self.policy, self.intake.processor(modality).max_bytes, what, modality)


def _remote(url) -> bool:
    """Whether fetching `url` waits on something outside the request (http(s), a file)."""
    return isinstance(url, str) and not url.startswith("data:")
