"""LoRA's cost per step (docs/lora.md): the engine without LoRA against the same batch of 8 rows
over 4 adapters of rank 16 (PEFT's, random, on every attention and MLP projection of both modes and
the self-conditioning MLP; then the same with the experts' tensors too), and with --enable-lora but
no adapter named, on the 15.8M bench
checkpoint of docs/benchmarks.md (/tmp/bench15, made here if missing): 8 prompts of 128 tokens, one
64-token canvas of 8 denoising steps each. One warmup generate per engine, then 5 alternating timed
generates; medians and their ratio. A printed ratio, no assertion: the goal is <= 1.15.

    OMP_NUM_THREADS=1 python benchmarks/lora_step.py
"""
import os, time
import torch
from blockdiff import LLM, LoRARequest, SamplingParams
from blockdiff.model.tiny import TinySpec, make_tiny_model

PATH = "/tmp/bench15"
SPEC = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_layers=6, num_heads=4, num_kv_heads=2,
            head_dim=64, global_head_dim=128, num_global_kv_heads=1, num_experts=16, top_k_experts=4,
            moe_intermediate_size=128, sliding_window=512, canvas_length=64)
TARGET = (r".*model\.(?:encoder\.language_model|decoder)\.(?:layers\.\d+\.(?:self_attn|mlp)\.(?:q|k|v|o|gate|up|down)_proj"
          r"|self_conditioning\.(?:gate|up|down)_proj)")


def adapter(i: int, experts: bool = False) -> str:
    out = f"/tmp/bench15_lora{i}" + ("_experts" if experts else "")
    if not os.path.isdir(out):
        import peft
        from transformers import DiffusionGemmaForBlockDiffusion
        torch.manual_seed(i)
        hf = DiffusionGemmaForBlockDiffusion.from_pretrained(PATH, dtype=torch.float32)
        params = ["experts.gate_up_proj", "experts.down_proj"] if experts else None
        model = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGET, target_parameters=params,
                                                        init_lora_weights=False))
        model.save_pretrained(out)
    return out


if not os.path.isdir(PATH):
    make_tiny_model(PATH, TinySpec(**SPEC))
loras = [LoRARequest(f"a{i}", i + 1, adapter(i)) for i in range(4)]
expert_loras = [LoRARequest(f"e{i}", i + 1, adapter(i, experts=True)) for i in range(4)]
B = 8
prompts = [torch.randint(3, 8000, (128,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(B)]
p = SamplingParams(max_tokens=64, max_denoising_steps=8, stability_threshold=8, ignore_eos=True, seed=0)
runs = {"base": (dict(), None), "lora, none named": (dict(enable_lora=True, max_loras=4), None),
        "4 adapters": (dict(enable_lora=True, max_loras=4), [loras[i % 4] for i in range(B)]),
        "4 on experts too": (dict(enable_lora=True, max_loras=4), [expert_loras[i % 4] for i in range(B)])}
llms = {name: LLM(PATH, **kw) for name, (kw, _) in runs.items()}
for name, llm in llms.items():
    llm.generate(prompts, p, use_tqdm=False, lora_request=runs[name][1])
ts = {k: [] for k in llms}
for _ in range(5):
    for name, llm in llms.items():
        t = time.perf_counter()
        llm.generate(prompts, p, use_tqdm=False, lora_request=runs[name][1])
        ts[name].append(time.perf_counter() - t)
med = {k: sorted(v)[2] for k, v in ts.items()}
for k, v in med.items():
    print(f"{k:>18}: {v:.3f} s per generate ({B} rows, 10 forwards), x{v / med['base']:.3f} of the base")
print(f"LoRA overhead (8 rows over 4 adapters of rank 16): {100 * (med['4 adapters'] / med['base'] - 1):+.1f}%")
print(f"with the experts' tensors too: {100 * (med['4 on experts too'] / med['base'] - 1):+.1f}%")
