"""Train the demo model with the DiffusionGemma objective, through blockdiff's own model code.

One training step on a batch of (prompt, answer) pairs:
  1. the encoder runs over each clean sequence (prompt + answer + EOS), keeping its K/V (the
     trainer's own attention, demo/dense_attention.py); its last hidden states give the
     autoregressive loss (next-token cross-entropy);
  2. each canvas of each answer (canvas k starts CL*k tokens into the answer; the positions after
     EOS hold <pad>) is corrupted: a level t ~ U(eps, 1) per canvas, and each position replaced by
     a uniformly random token with probability t (no mask token);
  3. a first decoder pass over the corrupted canvases, without gradients, reading the cache;
     softmax of its logits -> soft embeddings, kept for a canvas with probability 0.5 (zeros
     otherwise) as the self-conditioning input of
  4. the second decoder pass, whose cross-entropy against the clean canvas is the diffusion loss.
Decoder rows read only the encoder's K/V of positions before their canvas (the sliding window is
larger than any training sequence, so it never cuts). The loss is the
diffusion loss plus `ar_weight` (1 by default) times the autoregressive loss. Every draw comes from
generators seeded by `TrainConfig.seed`: the same seed gives the same model on the same machine,
thread count and number of data-parallel workers.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from blockdiff.demo.dense_attention import decoder_metadata, encoder_metadata
from blockdiff.demo.tasks import AGENT_TASKS, TASKS, Problem, training_problems
from blockdiff.demo.tokenizer import CHAT_TEMPLATE, TOKENIZER_CONFIG_DEMO, VOCAB, build_char_tokenizer, save_char_tokenizer
from blockdiff.parallel.self_conditioning import soft_embedding
from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.model.loader import load_model
from blockdiff.model.registry import parse_config
from blockdiff.model.saver import save_weights
from blockdiff.model.tiny import EOS, PAD, TinySpec, config_dict, generation_config_dict
from blockdiff.tokenizer import Tokenizer


IGNORE = -100

# Sampler defaults written to the checkpoint's generation_config.json.
GENERATION_DEFAULTS = {
    "max_new_tokens": 64,
    "max_denoising_steps": 16,
    "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}


def demo_spec(**overrides) -> TinySpec:
    """The demo model's shape: ~1.5M parameters, canvases of 8 tokens."""
    spec = dict(
        vocab_size=len(VOCAB), hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, global_head_dim=64, num_global_kv_heads=1, num_experts=4,
        top_k_experts=2, moe_intermediate_size=128, sliding_window=320, canvas_length=8,
        max_position_embeddings=1024, generation=dict(GENERATION_DEFAULTS), tokenizer=False,
    )
    spec.update(overrides)
    return TinySpec(**spec)


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    ar_weight: float = 1.0  # weight of the encoder's autoregressive loss
    t_eps: float = 1e-3
    self_conditioning_prob: float = 0.5
    seed: int = 0
    log_every: int = 50
    init_from: str | None = None  # a demo checkpoint to start from instead of random weights
    tasks: tuple[str, ...] = TASKS + AGENT_TASKS  # drawn in equal shares
    spec: TinySpec = field(default_factory=demo_spec)
    # Data-parallel processes, each with its share of every batch and of this process's threads,
    # their gradients averaged in one all-reduce per step (parallel/ranks.py); 1: this process only.
    workers: int = 1


@dataclass
class Example:
    prompt: list[int]  # the chat template around the conversation, ready for the model's reply
    answer: list[int]  # the reply's tokens (characters and agent markers) and EOS


def demo_tokenizer() -> Tokenizer:
    return Tokenizer(build_char_tokenizer(), TOKENIZER_CONFIG_DEMO, CHAT_TEMPLATE)


def chat_prompt(tokenizer: Tokenizer, question: str) -> list[int]:
    """The token ids `LLM.chat` sends for a one-message conversation."""
    return tokenizer.encode_chat([{"role": "user", "content": question}])


def encode(tokenizer: Tokenizer, problem: Problem) -> Example:
    prompt = tokenizer.encode_chat(problem.messages(), **problem.template_kwargs())
    return Example(prompt, tokenizer.encode(problem.answer, add_special_tokens=False) + [EOS])


def build_model(spec: TinySpec, seed: int) -> DiffusionGemma:
    """A float32 model of `spec` with fresh trainable weights: matrices N(0, 1/fan_in), the embedding
    N(0, 1/hidden) (it is scaled by sqrt(hidden) on input and is the LM head), every scale 1."""
    model = DiffusionGemma(parse_config(config_dict(spec)), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)  # every matrix is [..., out, in]
            p.requires_grad_(True)
    return model


def grown_from(path: str, spec: TinySpec, seed: int) -> DiffusionGemma:
    """A model of `spec` holding the weights of the demo checkpoint at `path`. The vocabulary may have
    grown since (new tokens are appended): the old embedding rows are kept and the new rows keep the
    random initialisation of build_model. Every other weight must have the same shape."""
    model = build_model(spec, seed)
    old = load_model(path, dtype=torch.float32)
    new_params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in old.named_parameters():
            target = new_params[name]
            if name == "embed.weight" and p.shape[0] <= target.shape[0] and p.shape[1:] == target.shape[1:]:
                target[: p.shape[0]] = p
            elif p.shape == target.shape:
                target.copy_(p)
            else:
                raise ValueError(f"{path}: {name} has shape {tuple(p.shape)}, the demo model needs {tuple(target.shape)}")
    return model


def training_loss(model: DiffusionGemma, examples: list[Example], cfg: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """The objective of the module docstring on one batch; -> (loss, its parts as floats)."""
    config = model.config
    cl, vocab = config.canvas_length, config.vocab_size
    length = max(len(e.prompt) + len(e.answer) for e in examples)
    window = config.sliding_window
    if window is not None and length > window - 1:
        raise ValueError(f"training sequences of {length} tokens need a sliding window above {length}, got {window}")

    # 1. encoder over the clean sequences
    enc_ids, ar_targets, lengths = [], [], []
    canvases, canvas_targets = [], []
    for e in examples:
        seq = e.prompt + e.answer
        start = len(enc_ids)
        enc_ids += seq
        lengths.append(len(seq))
        ar_targets += seq[1:] + [IGNORE]
        for k in range(0, len(e.answer), cl):
            canvases.append((start, len(e.prompt) + k))
            chunk = e.answer[k : k + cl]
            canvas_targets += chunk + [PAD] * (cl - len(chunk))
    kv = [(torch.zeros(len(enc_ids), s.kv_heads, s.head_dim), torch.zeros(len(enc_ids), s.kv_heads, s.head_dim))
          for s in model.kv_cache_spec()]
    hidden = model.backbone(torch.tensor(enc_ids), encoder_metadata(lengths), kv)
    ar_logits = _logits(model, hidden)
    ar_loss = F.cross_entropy(ar_logits, torch.tensor(ar_targets), ignore_index=IGNORE)

    # 2. corruption
    target = torch.tensor(canvas_targets).view(-1, cl)
    rows = target.shape[0]
    t = cfg.t_eps + (1 - cfg.t_eps) * torch.rand(rows, 1, generator=gen)
    noise = torch.randint(0, vocab, target.shape, generator=gen)
    dec_ids = torch.where(torch.rand(target.shape, generator=gen) < t, noise, target).view(-1)
    dec_meta = decoder_metadata(canvases, cl)

    # 3. self-conditioning input from a first pass without gradients
    with torch.no_grad():
        first = model(dec_ids, dec_meta, kv)
        soft = soft_embedding(first.softmax(-1).to(model.dtype), model.embed.weight, model.embed_scale)
        keep = torch.rand(rows, generator=gen) < cfg.self_conditioning_prob
        soft = soft * keep.repeat_interleave(cl).to(soft.dtype)[:, None]

    # 4. the second pass, with gradients
    logits = _logits(model, model.backbone(dec_ids, dec_meta, kv, soft))
    canvas_loss = F.cross_entropy(logits, target.view(-1))
    loss = canvas_loss + cfg.ar_weight * ar_loss
    return loss, {"loss": loss.item(), "canvas": canvas_loss.item(), "ar": ar_loss.item()}


def _logits(model: DiffusionGemma, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits with autograd: the final norm, the tied LM head and the soft-cap as
    `softcap * tanh(x / softcap)` (the inference model computes the cap in place, ops/softcap.py,
    which autograd cannot go through)."""
    logits = model.embed.logits(model.norm(hidden)).float()
    c = model.softcap
    return c * torch.tanh(logits / c) if c else logits


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up (at most a tenth of the run), then cosine decay to a tenth."""
    warmup = min(cfg.warmup, cfg.steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(cfg: TrainConfig, progress=None) -> tuple[DiffusionGemma, list[dict]]:
    """-> (trained model, per-step loss parts). `progress(step, parts)` is called every log_every steps.
    With cfg.workers > 1 the steps run in that many processes (this one is the first), each with
    its share of this process's threads: on 2 cores two single-threaded processes outran one with
    two threads, whose small products leave a thread idle (docs/demo.md)."""
    if cfg.workers == 1:
        return _train(cfg, progress)
    from blockdiff.parallel.ranks import RankProcesses

    threads = torch.get_num_threads()
    try:
        with RankProcesses(cfg.workers, "cpu") as ranks:
            ranks.context.state["progress"] = progress
            results = ranks.run(_train_rank, cfg, max(1, threads // cfg.workers), gather=True)
    finally:
        torch.set_num_threads(threads)
    model, history, checksum = results[0]
    sums = [checksum, *results[1:]]
    if len(set(sums)) != 1:  # every replica took the same steps from the same weights
        raise RuntimeError(f"the data-parallel replicas' weights differ after training: checksums {sums}")
    return model, history


def _train_rank(context, cfg: TrainConfig, threads: int):
    """One data-parallel rank's training; -> rank 0: (model, history, weight checksum), others: the checksum."""
    torch.set_num_threads(threads)
    model, history = _train(cfg, context.state.get("progress"), context.group, context.rank)
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    return (model, history, checksum) if context.rank == 0 else checksum


def _train(cfg: TrainConfig, progress=None, group=None, rank: int = 0) -> tuple[DiffusionGemma, list[dict]]:
    """The training loop on one process, or on one rank of a data-parallel `group`: every rank builds
    the same model and draws the same batches, takes every group.size-th example from its rank on,
    corrupts them with its own generator, and averages its gradients and loss parts with the others'
    before each optimizer step, so the replicas stay one model."""
    model = grown_from(cfg.init_from, cfg.spec, cfg.seed) if cfg.init_from else build_model(cfg.spec, cfg.seed)
    tokenizer = demo_tokenizer()
    problems = training_problems(random.Random(cfg.seed), cfg.tasks)
    gen = torch.Generator().manual_seed(cfg.seed + 1 + 1000 * rank)
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    size = 1 if group is None else group.size
    history = []
    model.train()
    for step in range(cfg.steps):
        batch = [next(problems) for _ in range(cfg.batch_size)]
        examples = [encode(tokenizer, p) for p in batch[rank::size]]
        loss, parts = training_loss(model, examples, cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if group is not None:
            parts = _average(model, parts, group)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(parts)
        if progress is not None and (step + 1) % cfg.log_every == 0:
            progress(step + 1, parts)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, history


def _average(model: DiffusionGemma, parts: dict, group) -> dict:
    """Every parameter's gradient and the loss parts averaged over the group, in one all-reduce."""
    params = list(model.parameters())
    for p in params:
        if p.grad is None:  # a weight this rank's examples did not reach: the others' may have
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.tensor(list(parts.values()))])
    group.all_reduce(flat).div_(group.size)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return dict(zip(parts, flat[offset:].tolist()))


def save_checkpoint(model: DiffusionGemma, cfg: TrainConfig, out_dir: str, report: dict | None = None) -> str:
    """The trained model in Hugging Face layout, with the tokenizer and the training record."""
    spec = cfg.spec
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict(spec), f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation_config_dict(spec), f, indent=2)
    save_weights(model, out_dir)  # the model's own (untrained) vision tower included: transformers loads it
    save_char_tokenizer(out_dir)
    with open(os.path.join(out_dir, "blockdiff_demo.json"), "w") as f:
        json.dump({"train_config": asdict(cfg), **(report or {})}, f, indent=2)
    return out_dir


def train_and_save(cfg: TrainConfig, out_dir: str) -> dict:
    """Train, save, and return the record written beside the checkpoint."""
    from tqdm import tqdm

    start = time.perf_counter()
    with tqdm(total=cfg.steps, desc="Training", unit="step") as bar:

        def progress(step: int, parts: dict) -> None:
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{parts['loss']:.4f}", canvas=f"{parts['canvas']:.4f}", ar=f"{parts['ar']:.4f}")

        model, history = train(cfg, progress)
    tail = history[-50:]
    report = {
        "wall_time_s": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": {k: round(sum(h[k] for h in tail) / len(tail), 4) for k in ("loss", "canvas", "ar")},
    }
    save_checkpoint(model, cfg, out_dir, report)
    return report
