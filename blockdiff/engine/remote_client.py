"""The engine client of a front end whose engines are replicas elsewhere, one client for two
transports: processes on this machine (`--data-parallel-size`, dp_client.DPClient over
core_process.py) and Ray Serve's replicas across a cluster (ray_transport.py, which
entrypoints/ray_serve.py deploys).

Either way the front end does what a server of one engine does before the engine: it resolves and
prices requests (an InputProcessor built from the replicas' handshake, so that the server checks
them as before) and keeps the tokenizer, the sampler and the image intake. The transport carries
API calls to the replicas and their outputs back, and each request goes where prefix_router.py's
`ReplicaRouting` sends it, fed with the replicas' KV events as the transport delivers them.
"""

from __future__ import annotations

from blockdiff.config import EngineConfig
from blockdiff.diffusion.registry import make_sampler
from blockdiff.engine.client import EngineClient
from blockdiff.engine.core_process import Handshake
from blockdiff.engine.input_processor import InputProcessor
from blockdiff.engine.multimodal import MultiModalIntake
from blockdiff.model.registry import load_config
from blockdiff.sampling_params import StructuredOutputsParams
from blockdiff.tokenizer import Tokenizer


class RemoteClient(EngineClient):
    """What a front end serves by without asking a replica: the replicas' limits and sampler
    defaults from their handshake `hs`, and the tokenizer, sampler, image intake and parameter
    resolution built here from the engine config, as the replicas built theirs. `cache_tokens`:
    the fewest KV tokens a replica holds (what a request may cost)."""

    def __init__(self, cfg: EngineConfig, hs: Handshake, cache_tokens: int):
        self.limits, self.defaults = hs.limits, hs.defaults
        self.tokenizer = Tokenizer.from_pretrained(cfg.tokenizer or cfg.model, cfg.chat_template)
        self.sampler = make_sampler(hs.sampler)
        self.mm = MultiModalIntake.from_pretrained(cfg, load_config(cfg.model), self.tokenizer)
        lim = self.limits
        # Resolution and cost as the replicas do them; a replica checks the rest when it takes a request.
        self.inputs = InputProcessor(self.tokenizer, self.sampler, self.defaults, hs.eos_token_ids, lim.vocab_size,
                                     lim.canvas_length, lim.max_model_len, lim.max_denoising_steps, cache_tokens, cfg.seed,
                                     self.mm)
        self.block_size, self.prefix_caching = hs.stats.block_size, hs.stats.prefix_caching
        self.prefix_cache_scope = hs.stats.prefix_cache_scope
        self.on_step = lambda seconds, engine="0": None
        self.on_finish = lambda finish_reason, prompt_tokens, generated_tokens, metrics, engine="0": None

    async def prepare(self, spec: StructuredOutputsParams, client: str | None = None) -> None:
        """Nothing here: the replica a request goes to builds its automaton, off its own loop, before
        it queues the request, and a spec it cannot serve comes back as the call's InvalidParam."""
