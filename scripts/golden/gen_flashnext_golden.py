#!/usr/bin/env python3
"""Flash-Next (`qwen4_exp`) toy checkpoint and reference goldens.

Run it through `scripts/golden/gen_flashnext_golden.sh`, which builds its own virtual
environment (target/venv-golden, pinned by scripts/requirements/requirements-golden.txt: torch,
transformers 5.24.0, safetensors, numpy). CI never runs this script: it checks the
committed outputs under tests/data/flashnext_toy/.

    scripts/golden/gen_flashnext_golden.sh                 # regenerate everything
    scripts/golden/gen_flashnext_golden.sh --check         # regenerate into a temp dir, diff

What the toy has (every feature of the real model, every matrix dim a multiple of 64)
-----------------------------------------------------------------------------------
hidden 128 · 8 layers, layer i `indexed_attention` when (i+1) % 4 == 0 (layers 3 and 7;
config.json spells them `full_attention`, as the real repo does) · hc_count 4, hc_lowrank
64 · GDN: 2 key heads × 64, 4 value heads × 64, conv 4, sigmoid output gate · attention:
4 query heads, 2 KV heads, head_dim 64, partial rotary 0.25 (16 dims), θ 1e7, QK-norm,
gated q_proj · QSA indexer: 4 heads × 64, 1 key head, budget 32, compress ratio 4 (8
blocks; a context of ≤ 35 tokens is dense-equivalent, the 200-token prompt is sparse) ·
MoE: 8 experts × 64, top-2, norm_topk_prob, gated shared expert (64) · PLE on layer
id 2 (tensors under layers.1): ple_embed_dim 320, ngram 3, 8 heads per order (16
heads, rows 20 wide, BF16 rows as in the real model), prime head vocabularies from base
500, table padded to a multiple of 64 (9024 rows) and saved in 4 shards of 2256 rows ·
vocab 512, untied lm_head, eos 502 (`<|im_end|>`) · a one-block vision tower
(`model.visual.*`, excluded by the family file) and one MTP layer (`mtp.*`, carried;
its names follow the replica's layout since transformers ignores `mtp.*`).

Weights are drawn with numpy from a seed per tensor name (sha256 of "seed:name"),
rounded to BF16, and written in the real on-disk layout: `model.language_model.*`
names straight from the reference's own state dict, fused `experts.gate_up_proj`
[E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I], the n-gram table split
in `ngram_embedding.shard_{s}.weight` as transformers' own Chunk op splits it,
HF-style shards `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`.

The goldens come from the reference, reloaded from that checkpoint with
`from_pretrained` (so the loader's renames and shard concatenation are exercised),
upcast to float32, eager attention, one CPU thread.

`scripts/golden/check_flashnext_notes.py` re-implements the forward pass from
REFERENCE_NOTES.md alone and checks it against these goldens.

Golden files (tests/data/flashnext_toy/golden/)
-----------------------------------------------
meta.json        versions, toy summary, prompts (ids and text), per-layer residual
                 ratios, tie statistics, file list.
short.safetensors  the 13-token prompt, every position; f32 unless noted:
    logits [T, V]; embed [T, H]; mixer.out [T, H];
    layers.{i}.in [T, 4H] (residual stream entering layer i);
    layers.1.ple.ids I64 [T, 16] (global rows of the concatenated n-gram table, bigram
      heads 0..7 then trigram 8..15); layers.1.ple.emb [T, 320]; layers.1.ple.out [T, 4H];
    layers.{i}.attn_hc.{mix [T, 4H] (sigmoid mix weights), mixed [T, H], inject [T, 4]};
    GDN layers: layers.{i}.gdn.qkv [T, 512] (in_proj_qkv, before conv),
      layers.{i}.gdn.core [T, 256] (delta-rule output before the gated norm),
      layers.{i}.gdn.gated [T, 256] (gated norm output, into out_proj), layers.{i}.gdn.out [T, H];
    indexed layers: layers.{i}.attn.gated [T, 256] (attention × sigmoid(gate), into
      o_proj), layers.{i}.attn.out [T, H], layers.{i}.indexer.scores [T, ⌊T/4⌋]
      (NaN where a block is not complete for that query);
    layers.{i}.after_attn [T, 4H]; layers.{i}.mlp_hc.{mix, mixed, inject};
    layers.{i}.moe.router_logits [T, E]; layers.{i}.moe.topk_idx I64 [T, 2] and
      layers.{i}.moe.topk_w [T, 2] (torch order: descending weight);
    layers.{i}.moe.shared [T, H] (sigmoid(shared_expert_gate) × shared expert);
    layers.{i}.moe.out [T, H]; layers.{i}.out [T, 4H].
long.safetensors   the 200-token prompt (it holds two `<|im_end|>` = EOS): logits [T, V],
    layers.1.ple.ids, layers.{i}.moe.topk_idx / topk_w, layers.{i}.indexer.scores at every
    position; `positions` I64 [P] (14 positions) and, at those positions only, embed,
    layers.{i}.{in, after_attn, out, gdn.out or attn.out, moe.out}, layers.1.ple.out,
    mixer.out (each [P, ...]).
indexer.json     per indexed layer and prompt: for every query position, the selected
                 complete blocks (sorted; block b = tokens 4b..4b+3) — the incomplete
                 tail block is always selected on top — and the positions whose top-k
                 boundary is a tie (`ties`), with the set a lowest-index-first tie break
                 would have chosen where it differs (`lowest_first_differs`).
rollouts.json    greedy rollouts with the KV/GDN cache: `short` (13-token prompt + 20,
                 dense-equivalent throughout) and `long` (200-token prompt + 40, sparse):
                 prompt, tokens, top-2 ids and margin (logit1 − logit2) per step, the
                 indexer's blocks per decode step and layer, and the max |Δ| between the
                 cached step logits and a re-prefill of the whole sequence.
rollouts.safetensors  short.step_logits [20, V], long.step_logits [40, V].
topk_ties.json   torch.topk(largest) on tie-heavy f32 vectors: inputs, k, indices in
                 torch order (`path`: which libstdc++ routine torch took). `emulate_topk`
                 below reproduces them (checked against torch on 20,000 vectors each
                 run); REFERENCE_NOTES.md describes the algorithm.

Where torch.topk tie-breaking matters: the indexer's block top-k (relu makes exact-zero
scores common; a boundary inside a run of zeros is decided by the tie rule) and, in
principle, the router (continuous f32 softmax values; no ties seen). torch's CPU topk
is libstdc++'s std::nth_element (or partial_sort when k·64 ≤ n) over (value, index)
pairs with "a before b iff a.value > b.value (NaN first)"; see REFERENCE_NOTES.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

SEED = 20260601
H = 128
HC = 4
VOCAB = 512
EOS = 502
SPECIALS = [  # (content, id): appended after the 500 BPE tokens, in id order
    ("<|endoftext|>", 500),
    ("<|im_start|>", 501),
    ("<|im_end|>", 502),
    ("<|vision_start|>", 503),
    ("<|vision_end|>", 504),
    ("<|image_pad|>", 505),
    ("<|video_pad|>", 506),
]
BPE_VOCAB = 500
MAX_SHARD_BYTES = 2_500_000
SHORT_STEPS = 20
LONG_STEPS = 40
LONG_PROMPT_LEN = 200
LONG_TRACE_POSITIONS = [0, 1, 2, 3, 4, 5, 6, 7, 35, 36, 63, 99, 150, 199]


def text_config() -> dict:
    layers = 8
    return {
        "model_type": "qwen4_exp_text",
        "dtype": "bfloat16",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        # The real repo spells the indexed layers "full_attention"; the reference maps
        # that legacy name to "indexed_attention".
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attn_output_gate": True,
        "output_gate_type": "sigmoid",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "hc_count": HC,
        "hc_lowrank": 64,
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 64,
        "indexer_budget": 32,
        "indexer_compress_ratio": 4,
        "ple_layer_ids": [2],
        "ple_embed_dim": 320,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": 500,
        "make_ngram_vocab_size_divisible_by": 64,
        "split_ngram_parts": 4,
        "seed": 1234,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": EOS,
        "max_position_embeddings": 4096,
        "mtp_num_hidden_layers": 1,
    }


def full_config() -> dict:
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "vision_start_token_id": 503,
        "vision_end_token_id": 504,
        "image_token_id": 505,
        "video_token_id": 506,
        "text_config": text_config(),
        "vision_config": {
            "model_type": "qwen4_exp_vision",
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 1,
            "in_channels": 3,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "num_position_embeddings": 16,
            "out_hidden_size": H,
            "hidden_act": "gelu_pytorch_tanh",
        },
    }


# ---------------------------------------------------------------------------------
# Weights


def rng_for(name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{SEED}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def normal(name: str, shape, std: float, mean: float = 0.0) -> np.ndarray:
    return (mean + std * rng_for(name).standard_normal(shape)).astype(np.float32)


def uniform(name: str, shape, lo: float, hi: float) -> np.ndarray:
    return rng_for(name).uniform(lo, hi, shape).astype(np.float32)


def init_value(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The toy's weights: unit-variance activations through every block, so that each
    block adds O(1) to the residual stream (see `residual_ratios` in meta.json)."""
    base = name.removesuffix(".weight")
    if name.endswith("linear_attn.norm.weight"):
        return normal(name, shape, 0.1, mean=1.0)  # gated RMSNorm: plain weight
    if base.endswith(("norm", "norm_key", "norm_query", "norm_conv")):
        return normal(name, shape, 0.1)  # offset RMSNorm: x̂·(1 + w)
    if name.endswith("A_log"):
        return np.log(uniform(name, shape, 0.05, 2.0))
    if name.endswith("dt_bias"):
        return uniform(name, shape, -0.5, 1.0)
    if name.endswith("conv1d.weight"):
        return normal(name, shape, 0.5)  # depthwise, kernel 4
    if "ngram_embedding" in name or name.endswith("embed_tokens.weight"):
        return normal(name, shape, 1.0)
    if name.endswith(TIE_HEAVY_INDEXER):
        return tie_heavy_indexer(name, shape)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) or (
        ".shared_expert." in name or name.endswith(("v_proj.weight", "o_proj.weight"))
    ):
        # Gain 2: the MoE and attention outputs are averages (of experts, of values), so
        # unit-gain weights would leave these blocks at ~0.1 of the residual.
        return normal(name, shape, 2.0 / math.sqrt(shape[-1]))
    if name.endswith("input_mix_weight_down.weight"):
        # The reference divides this projection by hc_count before the silu.
        return normal(name, shape, HC * 1.0 / math.sqrt(shape[-1]))
    if name.endswith("input_mix_weight_up.weight"):
        return normal(name, shape, 2.0 / math.sqrt(shape[-1]))
    if name.endswith("block_inject_weight.weight"):
        return normal(name, shape, HC * 1.0 / math.sqrt(shape[-1]))
    if name.endswith("mlp.gate.weight"):
        return normal(name, shape, 2.0 / math.sqrt(shape[-1]))
    if name.endswith("lm_head.weight"):
        return normal(name, shape, 4.0 / math.sqrt(shape[-1]))
    if len(shape) >= 2:
        fan_in = int(np.prod(shape[1:]))
        return normal(name, shape, 1.0 / math.sqrt(fan_in))
    if name.endswith(".bias"):
        return normal(name, shape, 0.02)
    return normal(name, shape, 0.1)


# The last indexed layer's indexer gets near-identical query heads, so all four heads
# often agree in sign and relu-sum scores are exactly zero for about half the blocks:
# its top-k boundary then falls inside a run of equal scores, and the goldens pin
# torch.topk's tie rule (the first indexed layer keeps independent heads).
TIE_HEAVY_INDEXER = "layers.7.self_attn.indexer.index_qk_proj.weight"


def tie_heavy_indexer(name: str, shape) -> np.ndarray:
    rows, cols = shape
    d = text_config()["indexer_head_dim"]
    heads = rows // d - 1
    std = 1.0 / math.sqrt(cols)
    shared = normal(name + ":shared", (d, cols), std)
    q = [shared + 0.25 * normal(f"{name}:q{h}", (d, cols), std) for h in range(heads)]
    k = normal(name + ":k", (d, cols), std)
    return np.concatenate(q + [k]).astype(np.float32)


def bf16_round(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16)


def mtp_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """One MTP draft layer. transformers ignores `mtp.*`, so these names follow the
    scaled replica's layout (which the family file's `mtp.**` rule carries)."""
    h, wide, r = cfg["hidden_size"], cfg["hc_count"] * cfg["hidden_size"], cfg["hc_lowrank"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, i, s = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    out = [
        ("mtp.fc_embedding.weight", (h, h)),
        ("mtp.fc_hidden.weight", (h, h)),
        ("mtp.pre_fc_norm_embedding.weight", (h,)),
        ("mtp.pre_fc_norm_hidden.weight", (h,)),
        ("mtp.hyper_connection_mixer.hc_norm.weight", (wide,)),
        ("mtp.hyper_connection_mixer.input_mix_weight_down.weight", (r, wide)),
        ("mtp.hyper_connection_mixer.input_mix_weight_up.weight", (wide, r)),
    ]
    p = "mtp.layers.0."
    out += [
        (f"{p}self_attn.q_proj.weight", (2 * nh * hd, h)),
        (f"{p}self_attn.k_proj.weight", (nkv * hd, h)),
        (f"{p}self_attn.v_proj.weight", (nkv * hd, h)),
        (f"{p}self_attn.o_proj.weight", (h, nh * hd)),
        (f"{p}self_attn.q_norm.weight", (hd,)),
        (f"{p}self_attn.k_norm.weight", (hd,)),
    ]
    for block in ("attn", "mlp"):
        b = f"{p}{block}_hyper_connection."
        out += [
            (f"{b}hc_norm.weight", (wide,)),
            (f"{b}input_mix_weight_down.weight", (r, wide)),
            (f"{b}input_mix_weight_up.weight", (wide, r)),
            (f"{b}block_inject_weight.weight", (cfg["hc_count"], wide)),
        ]
    out += [
        (f"{p}mlp.gate.weight", (e, h)),
        (f"{p}mlp.experts.gate_up_proj", (e, 2 * i, h)),
        (f"{p}mlp.experts.down_proj", (e, h, i)),
        (f"{p}mlp.shared_expert.gate_proj.weight", (s, h)),
        (f"{p}mlp.shared_expert.up_proj.weight", (s, h)),
        (f"{p}mlp.shared_expert.down_proj.weight", (h, s)),
        (f"{p}mlp.shared_expert_gate.weight", (1, h)),
    ]
    return out


def build_checkpoint_tensors(model, cfg: dict) -> list[tuple[str, torch.Tensor]]:
    """Every on-disk tensor, in the order save_pretrained would write them (the
    reference's state dict), with the n-gram table split as the reverse of the loader's
    Concatenate op (torch.chunk into split_ngram_parts), then `mtp.*`."""
    out: list[tuple[str, torch.Tensor]] = []
    parts = cfg["split_ngram_parts"]
    for name, value in model.state_dict().items():
        if value.dtype == torch.int64:  # PLE hash tables: exact, from the reference
            out.append((name, value.clone().contiguous()))
            continue
        if name.endswith("ngram_embedding.weight"):
            rows = value.shape[0]
            chunks = torch.chunk(torch.empty(rows), parts)
            if len(chunks) != parts or len({c.shape[0] for c in chunks}) != 1:
                raise SystemExit(f"{rows} n-gram rows do not split into {parts} equal shards")
            stem = name.removesuffix("weight")
            for s, c in enumerate(chunks):
                shard = f"{stem}shard_{s}.weight"
                out.append((shard, bf16_round(init_value(shard, (c.shape[0], value.shape[1])))))
            continue
        out.append((name, bf16_round(init_value(name, tuple(value.shape)))))
    for name, shape in mtp_tensors(cfg):
        out.append((name, bf16_round(init_value(name, shape))))
    return out


def write_checkpoint(out_dir: Path, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """HF-style sharding: state-dict order, a new shard when the next tensor would pass
    MAX_SHARD_BYTES; index with total_size and a sorted weight_map."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > MAX_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    n = len(groups)
    weight_map = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: v for k, v in group}, str(out_dir / fname), metadata={"format": "pt"})
        for k, v in group:
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out_dir / "model.safetensors.index.json", index)
    return {"shards": n, "total_size": total, "tensors": len(tensors)}


def write_json(path: Path, value, compact: bool = False) -> None:
    if compact:
        text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    else:
        text = json.dumps(value, indent=2, sort_keys=True)
    path.write_text(text + "\n")


# ---------------------------------------------------------------------------------
# Tokenizer: a byte-level BPE trained on a fixed text, so every id below 500 decodes.

CORPUS = """\
The quick brown fox jumps over the lazy dog while the install streams every shard.
A model that does not fit in memory can still run from a local disk, one expert at a
time, when the runtime reads each expert with one aligned read and keeps a bounded
cache of the ones it used last. The installer plans every byte before it writes any,
so the dry run and the real install agree to the byte, and the receipt proves it.
Hyper-connections keep four residual streams of the hidden width; every block reads a
learned mix of them and writes its output back into each stream with its own weight.
The linear attention layers keep a small recurrent state per head, updated by the
gated delta rule, and a short causal convolution in front of it. Every fourth layer
attends to the whole context, but an indexer first scores blocks of four keys and keeps
only the best of them, together with the recent tail, so long prompts stay cheap.
The n-gram embedding hashes the current token with the one or two before it, looks up
sixteen rows in a very large table, and gates their projection by the residual stream.
Routers pick two experts out of eight for every token and mix their outputs with the
renormalised probabilities; a shared expert, gated by a sigmoid, is always added.
Numbers and names: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096.
Questions, answers, and lists: what is a token? It is a piece of text with an id.
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB:
        raise SystemExit(f"BPE trained {tok.get_vocab_size()} tokens, wanted {BPE_VOCAB}")
    from tokenizers import AddedToken

    for content, want in SPECIALS:
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        if tok.token_to_id(content) != want:
            raise SystemExit(f"{content} got id {tok.token_to_id(content)}, wanted {want}")
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for c, i in SPECIALS
    }
    write_json(out_dir / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "Qwen2Tokenizer",
    })
    write_json(out_dir / "generation_config.json", {
        "do_sample": False,
        "eos_token_id": [EOS],
        "pad_token_id": 500,
        "transformers_version": "5.24.0",
    })
    return Tokenizer.from_file(str(out_dir / "tokenizer.json"))


def prompts(tok) -> dict:
    short_text = "The quick brown fox jumps"
    short = tok.encode(short_text).ids
    cfg = text_config()
    dense_max = cfg["indexer_budget"] + cfg["indexer_compress_ratio"] - 1
    if len(short) + SHORT_STEPS - 1 > dense_max:
        raise SystemExit(f"short rollout would pass the {dense_max}-token dense context")
    conv = (
        "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n"
        "<|im_start|>user\nExplain how the installer and the runtime work together, in "
        "plain words, and say what the indexer keeps.<|im_end|>\n"
        "<|im_start|>assistant\n" + CORPUS
    )
    long = tok.encode(conv).ids[:LONG_PROMPT_LEN]
    if len(long) != LONG_PROMPT_LEN:
        raise SystemExit(f"long prompt has {len(long)} tokens, wanted {LONG_PROMPT_LEN}")
    return {
        "short": {"text": short_text, "ids": short},
        "long": {"text": tok.decode(long, skip_special_tokens=False), "ids": long},
    }


# ---------------------------------------------------------------------------------
# Recording the reference


class Recorder:
    """Forward hooks on the reference modules; every capture is f32 [T, ...]."""

    def __init__(self, model, cfg: dict):
        self.cfg = cfg
        self.data: dict[str, torch.Tensor] = {}
        self.topk_calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.indexer_calls: dict[str, list] = {}  # per indexer: (scores, topk indices) per query
        self.indexer_masks: dict[str, torch.Tensor] = {}  # per indexer: the selection mask it returned
        self.in_indexer = False
        self.handles = []
        lm = model.model
        self.hook(lm.embed_tokens, "embed", out=True)
        for i, layer in enumerate(lm.layers):
            p = f"layers.{i}."
            self.hook(layer, p + "in", inp=True)
            self.hook(layer, p + "out", out=True)
            self.hook_hc(layer.attn_hyper_connection, p + "attn_hc")
            self.hook_hc(layer.mlp_hyper_connection, p + "mlp_hc")
            if layer.ple is not None:
                self.hook(layer.ple, p + "ple.out", out=True)
                self.hook(layer.ple.ple_embedding, p + "ple.emb", out=True)
                self.hook(layer.ple.ple_embedding.ngram_embedding, p + "ple.ids", inp=True)
            if layer.layer_type == "linear_attention":
                la = layer.linear_attn
                self.hook(la.in_proj_qkv, p + "gdn.qkv", out=True)
                self.hook(la.norm, p + "gdn.core", inp=True, reshape_tokens=True)
                self.hook(la.out_proj, p + "gdn.gated", inp=True)
                self.hook(la, p + "gdn.out", out=True)
            else:
                sa = layer.self_attn
                self.hook(sa.o_proj, p + "attn.gated", inp=True)
                self.hook(sa, p + "attn.out", out=True, first=True)
                self.hook_indexer(sa.indexer, p + "indexer")
            self.hook(layer.mlp, p + "moe.out", out=True)
            self.hook_router(layer.mlp.gate, p + "moe")
            self.hook_shared(layer.mlp, p + "moe.shared")
            self.hook_after_attn(layer, p + "after_attn")
        self.hook(lm.hyper_connection_mixer, "mixer.out", out=True)
        self.orig_topk = torch.Tensor.topk
        recorder = self

        def topk(t, *args, **kwargs):
            res = recorder.orig_topk(t, *args, **kwargs)
            if recorder.in_indexer:
                recorder.topk_calls.append((t.detach().clone(), res.indices.detach().clone()))
            return res

        torch.Tensor.topk = topk

    def close(self):
        torch.Tensor.topk = self.orig_topk
        for h in self.handles:
            h.remove()

    def put(self, key, value):
        value = value.detach()
        if value.dim() >= 3 and value.shape[0] == 1:  # drop the batch of one
            value = value[0]
        self.data[key] = value.clone()

    def hook(self, module, key, inp=False, out=False, first=False, reshape_tokens=False):
        def fn(_m, args, output):
            if inp:
                v = args[0]
                if reshape_tokens:  # (T·heads, d) -> (T, heads·d)
                    t = self.data["embed"].shape[0]
                    v = v.reshape(t, -1)
                self.put(key, v)
            if out:
                v = output[0] if (first or isinstance(output, tuple)) else output
                self.put(key, v)

        self.handles.append(module.register_forward_hook(fn))

    def hook_hc(self, module, key):
        def fn(_m, args, output):
            mixed, _x, inject = output
            self.put(key + ".mixed", mixed)
            self.put(key + ".inject", inject)

        self.handles.append(module.register_forward_hook(fn))

        # sigmoid(input_mix_weight_up(...)) is the mix; capture the pre-sigmoid and apply it.
        def up_fn(_m, args, output):
            self.put(key + ".mix", torch.sigmoid(output))

        self.handles.append(module.input_mix_weight_up.register_forward_hook(up_fn))

    def hook_indexer(self, module, key):
        def pre(_m, args):
            self.in_indexer = True
            self.topk_calls = []

        def post(_m, args, output):
            self.in_indexer = False
            self.indexer_calls[key] = list(self.topk_calls)
            self.indexer_masks[key] = output.detach().clone()

        self.handles.append(module.register_forward_pre_hook(pre))
        self.handles.append(module.register_forward_hook(post))

    def hook_router(self, module, key):
        def fn(_m, args, output):
            logits, weights, idx = output
            self.put(key + ".router_logits", logits)
            self.put(key + ".topk_w", weights)
            self.put(key + ".topk_idx", idx)

        self.handles.append(module.register_forward_hook(fn))

    def hook_shared(self, mlp, key):
        store = {}

        def se(_m, args, output):
            store["se"] = output

        def gate(_m, args, output):
            self.put(key, torch.sigmoid(output) * store["se"])

        self.handles.append(mlp.shared_expert.register_forward_hook(se))
        self.handles.append(mlp.shared_expert_gate.register_forward_hook(gate))

    def hook_after_attn(self, layer, key):
        # The residual after the attention block is the input of mlp_hyper_connection.
        def pre(_m, args):
            self.put(key, args[0])

        self.handles.append(layer.mlp_hyper_connection.register_forward_pre_hook(pre))

    def reset(self):
        self.data = {}
        self.indexer_calls = {}
        self.indexer_masks = {}


def no_grad(fn):
    def wrapped(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapped


@no_grad
def forward_prompt(model, rec: Recorder, ids: list[int]) -> dict:
    rec.reset()
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    data = dict(rec.data)
    data["logits"] = out.logits[0].float().clone()
    return {"data": data, "indexer_calls": dict(rec.indexer_calls), "masks": dict(rec.indexer_masks)}


def boundary_tie(scores: torch.Tensor, idx: torch.Tensor, k_max: int) -> tuple[bool, list[int]]:
    """Whether the k-th selected score equals an unselected one (the tie rule decides
    the set), and the set a lowest-index-first tie break would pick."""
    n = scores.shape[0]
    k = min(k_max, n)
    if k >= n:
        return False, sorted(idx.tolist())
    chosen = set(idx.tolist())
    kth = scores[idx].min()
    tie = any(bool(scores[j] == kth) for j in range(n) if j not in chosen)
    order = sorted(range(n), key=lambda j: (-float(scores[j]), j))
    return tie, sorted(order[:k])


def indexer_sets(run: dict, t: int, cfg: dict) -> tuple[dict, dict]:
    """Selected blocks per query from the reference's own topk calls, checked against
    the selection mask the indexer returned; scores as [T, T/cr] with NaN padding."""
    cr = cfg["indexer_compress_ratio"]
    k_max = cfg["indexer_budget"] // cr
    out, scores_out = {}, {}
    for key, calls in run["indexer_calls"].items():
        mask = run["masks"][key][0, 0]  # [T, kv]
        first_query = cr - 1  # the first query with a complete block
        if len(calls) != t - first_query:
            raise SystemExit(f"{key}: {len(calls)} topk calls for {t} queries")
        blocks, ties, differs = [], [], {}
        scores = torch.full((t, t // cr), float("nan"))
        for q in range(t):
            if q < first_query:
                sel = []
            else:
                s, idx = calls[q - first_query]
                n = s.shape[0]
                if n != (q + 1) // cr:
                    raise SystemExit(f"{key}: query {q} scored {n} blocks")
                scores[q, :n] = s
                sel = sorted(idx.tolist())
                tie, lowest = boundary_tie(s, idx, k_max)
                if tie:
                    ties.append(q)
                    if lowest != sel:
                        differs[str(q)] = lowest
            # The mask must be exactly these blocks plus the incomplete tail.
            tail = list(range(((q + 1) // cr) * cr, q + 1))
            want = sorted([b * cr + j for b in sel for j in range(cr)] + tail)
            got = torch.nonzero(mask[q]).flatten().tolist()
            if got != want:
                raise SystemExit(f"{key}: query {q} mask {got} != blocks {sel} + tail {tail}")
            blocks.append(sel)
        layer = key.removesuffix(".indexer")
        out[layer] = {"blocks": blocks, "ties": ties, "lowest_first_differs": differs}
        scores_out[f"{layer}.indexer.scores"] = scores
    return out, scores_out


@no_grad
def rollout(model, rec: Recorder, prompt: list[int], steps: int, cfg: dict) -> dict:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    tokens, top2, margins, step_logits, step_blocks = [], [], [], [], []
    cr = cfg["indexer_compress_ratio"]
    k_max = cfg["indexer_budget"] // cr
    decode_ties = []
    feed = list(prompt)
    for step in range(steps):
        rec.reset()
        out = model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True)
        logits = out.logits[0, -1].float()
        vals, ids = torch.sort(logits, descending=True, stable=True)
        margin = float(vals[0] - vals[1])
        tok = int(ids[0])
        blocks = {}
        for key, calls in rec.indexer_calls.items():
            ctx = len(prompt) + step
            if (ctx // cr) == 0:
                blocks[key.removesuffix(".indexer")] = []
            else:
                s, idx = calls[-1]
                if s.shape[0] != ctx // cr:
                    raise SystemExit(f"{key}: decode step {step} scored {s.shape[0]} blocks")
                blocks[key.removesuffix(".indexer")] = sorted(idx.tolist())
                if boundary_tie(s, idx, k_max)[0]:
                    decode_ties.append([step, key.removesuffix(".indexer")])
        tokens.append(tok)
        top2.append([int(ids[0]), int(ids[1])])
        margins.append(margin)
        step_logits.append(logits.clone())
        step_blocks.append(blocks)
        feed = [tok]
    # Re-prefill the whole sequence: its logits must match the cached steps.
    full = list(prompt) + tokens[:-1]
    rec.reset()
    ref = model(input_ids=torch.tensor([full]), use_cache=False).logits[0].float()
    again = ref[len(prompt) - 1:]
    # ... and so must the indexer's sets at those queries.
    reprefill_set_mismatches = []
    first_query = cr - 1
    for key, calls in rec.indexer_calls.items():
        layer = key.removesuffix(".indexer")
        for step in range(steps):
            q = len(prompt) - 1 + step
            if q < first_query:
                continue
            want = sorted(calls[q - first_query][1].tolist())
            if want != step_blocks[step][layer]:
                reprefill_set_mismatches.append([step, layer])
    stacked = torch.stack(step_logits)
    diff = float((again - stacked).abs().max())
    if not torch.equal(again.argmax(-1), stacked.argmax(-1)):
        raise SystemExit("re-prefill argmax differs from the cached rollout")
    return {
        "prompt": list(prompt),
        "tokens": tokens,
        "top2": top2,
        "margins": margins,
        "min_margin": min(margins),
        "indexer_blocks": step_blocks,
        "reprefill_max_abs_diff": diff,
        "reprefill_indexer_set_mismatches": reprefill_set_mismatches,
        "decode_boundary_ties": decode_ties,
        "step_logits": stacked,
    }


def residual_ratios(data: dict, cfg: dict) -> list[dict]:
    """||block contribution|| / ||residual before it||, over all positions."""
    out = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x_in = data[p + "in"]
        row = {"layer": i}
        if p + "ple.out" in data:
            row["ple"] = float(data[p + "ple.out"].norm() / x_in.norm())
            x_in = x_in + data[p + "ple.out"]
        mid, x_out = data[p + "after_attn"], data[p + "out"]
        row["attn"] = float((mid - x_in).norm() / x_in.norm())
        row["mlp"] = float((x_out - mid).norm() / mid.norm())
        row["out_over_in"] = float(x_out.norm() / data[p + "in"].norm())
        out.append(row)
    return out


def topk_vectors() -> list[dict]:
    """Tie-heavy inputs and torch.topk's answers (CPU, largest=True, sorted=True)."""
    rnd = random.Random(7)
    cases = []
    shapes = [(5, 3), (8, 4), (9, 8), (10, 8), (12, 8), (16, 8), (17, 8), (25, 8), (33, 8),
              (50, 8), (64, 10), (100, 8), (129, 2), (200, 3), (512, 10), (600, 8)]
    for n, k in shapes:
        for style in ("relu", "levels"):
            if style == "relu":
                vals = [max(0.0, rnd.gauss(0.0, 1.0)) if rnd.random() < 0.4 else 0.0 for _ in range(n)]
            else:
                vals = [float(rnd.randint(0, 3)) for _ in range(n)]
            t = torch.tensor(vals, dtype=torch.float32)
            res = t.topk(k)
            cases.append({
                "n": n, "k": k,
                "values": [float(v) for v in t.tolist()],
                "indices": res.indices.tolist(),
                "path": "partial_sort" if k * 64 <= n else "nth_element",
            })
    return cases


def emulate_topk(values: list[float], k: int) -> list[int]:
    """torch CPU topk(largest=True) as libstdc++ runs it: nth_element (introselect)
    when k·64 > n, else partial_sort (heap select + sort_heap), on (value, index) pairs
    in index order with "a before b iff a.value > b.value, NaN first". Returns the
    first k indices; their set is torch's, and so is their order in the partial_sort
    case (in the nth_element case torch then std::sorts the first k−1, which only
    reorders)."""
    q = [(float(v), j) for j, v in enumerate(values)]
    n = len(q)

    def comp(x, y):
        return (math.isnan(x[0]) and not math.isnan(y[0])) or x[0] > y[0]

    def adjust_heap(first, hole, length, value):
        top = child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if comp(q[first + child], q[first + child - 1]):
                child -= 1
            q[first + hole] = q[first + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            q[first + hole] = q[first + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and comp(q[first + parent], value):
            q[first + hole] = q[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        q[first + hole] = value

    def make_heap(first, last):
        length = last - first
        if length < 2:
            return
        parent = (length - 2) // 2
        while True:
            adjust_heap(first, parent, length, q[first + parent])
            if parent == 0:
                return
            parent -= 1

    def pop_heap(first, last, result):
        value = q[result]
        q[result] = q[first]
        adjust_heap(first, 0, last - first, value)

    def heap_select(first, middle, last):
        make_heap(first, middle)
        for i in range(middle, last):
            if comp(q[i], q[first]):
                pop_heap(first, middle, i)

    def swap(a, b):
        q[a], q[b] = q[b], q[a]

    def median_to_first(result, a, b, c):
        if comp(q[a], q[b]):
            if comp(q[b], q[c]):
                swap(result, b)
            elif comp(q[a], q[c]):
                swap(result, c)
            else:
                swap(result, a)
        elif comp(q[a], q[c]):
            swap(result, a)
        elif comp(q[b], q[c]):
            swap(result, c)
        else:
            swap(result, b)

    def partition(first, last, pivot):
        while True:
            while comp(q[first], q[pivot]):
                first += 1
            last -= 1
            while comp(q[pivot], q[last]):
                last -= 1
            if not first < last:
                return first
            swap(first, last)
            first += 1

    def insertion_sort(first, last):
        for i in range(first + 1, last):
            val = q[i]
            if comp(val, q[first]):
                q[first + 1:i + 1] = q[first:i]
                q[first] = val
            else:
                j = i
                while comp(val, q[j - 1]):
                    q[j] = q[j - 1]
                    j -= 1
                q[j] = val

    if k * 64 <= n:
        heap_select(0, k, n)
        last = k
        while last > 1:
            last -= 1
            pop_heap(0, last, last)
    elif n > 0:
        first, last, nth = 0, n, k - 1
        depth = 2 * (n.bit_length() - 1)
        while last - first > 3:
            if depth == 0:
                heap_select(first, nth + 1, last)
                swap(first, nth)
                break
            depth -= 1
            median_to_first(first, first + 1, first + (last - first) // 2, last - 1)
            cut = partition(first + 1, last, first)
            if cut <= nth:
                first = cut
            else:
                last = cut
        else:
            insertion_sort(first, last)
    return [j for _, j in q[:k]]


def check_topk_emulation(trials: int) -> int:
    rnd = random.Random(11)
    for _ in range(trials):
        n = rnd.choice([2, 3, 4, 5, 7, 8, 9, 10, 12, 16, 17, 31, 50, 64, 100, 129, 300, 513, 700, 2000])
        k = rnd.randint(1, n) if rnd.random() < 0.7 else rnd.randint(1, max(1, n // 64))
        if rnd.random() < 0.5:
            vals = [float(rnd.randint(0, rnd.choice([1, 2, 3, 5, n]) - 1)) for _ in range(n)]
        else:
            vals = [max(0.0, rnd.gauss(0, 1)) if rnd.random() < 0.5 else 0.0 for _ in range(n)]
        t = torch.tensor(vals, dtype=torch.float32)
        ref = t.topk(k).indices.tolist()
        em = emulate_topk(t.tolist(), k)
        if set(ref) != set(em) or (k * 64 <= n and ref != em):
            raise SystemExit(f"topk emulation differs from torch: n={n} k={k} {vals}")
    return trials


def save_tensors(path: Path, tensors: dict) -> None:
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path),
              metadata={"format": "pt"})  # one key: safetensors orders metadata by hash


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("tests/data/flashnext_toy"))
    ap.add_argument("--topk-trials", type=int, default=20000)
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and compare with --out byte for byte")
    args = ap.parse_args()
    if args.check:
        import filecmp
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / "toy"
            subprocess.run([sys.executable, __file__, "--out", str(fresh),
                            "--topk-trials", str(args.topk_trials)], check=True,
                           stdout=subprocess.DEVNULL)
            old = sorted(str(p.relative_to(args.out)) for p in args.out.rglob("*") if p.is_file()
                         and p.name not in ("REFERENCE_NOTES.md",))
            new = sorted(str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file())
            bad = sorted(set(old) ^ set(new))
            bad += [f for f in new if f in old and not filecmp.cmp(args.out / f, fresh / f, shallow=False)]
            if bad:
                raise SystemExit(f"regenerated files differ: {bad}")
            print(f"{len(new)} files regenerate byte for byte")
        return
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    import transformers
    from transformers import AutoConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

    out: Path = args.out
    # Everything here is generated, except the hand-written notes beside it.
    if out.exists():
        for p in out.iterdir():
            if p.name == "REFERENCE_NOTES.md":
                continue
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    golden = out / "golden"
    golden.mkdir(parents=True)

    write_json(out / "config.json", full_config())
    config = AutoConfig.from_pretrained(out)
    tcfg = config.text_config
    if tcfg.layer_types[3] != "indexed_attention":
        raise SystemExit("config did not map full_attention to indexed_attention")
    torch.manual_seed(0)
    skeleton = Qwen4ExpForConditionalGeneration(config)
    tensors = build_checkpoint_tensors(skeleton, text_config())
    del skeleton
    ckpt = write_checkpoint(out, tensors)
    tok = write_tokenizer(out)
    saved = dict(tensors)

    # The reference, as a user loads it: the text model from the real layout, f32.
    model, info = Qwen4ExpForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    if info["missing_keys"] or info["mismatched_keys"]:
        raise SystemExit(f"reference load: {info}")
    loaded = model.state_dict()
    cfg = text_config()
    parts = cfg["split_ngram_parts"]
    for name, value in loaded.items():
        src = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        if src.endswith("ngram_embedding.weight"):
            stem = src.removesuffix("weight")
            want = torch.cat([saved[f"{stem}shard_{s}.weight"] for s in range(parts)])
        elif src in saved:
            want = saved[src]
        else:
            continue  # non-persistent buffers
        if not torch.equal(value, want.to(value.dtype)):
            raise SystemExit(f"reference loaded {name} differently from {src} on disk")
    # The multimodal class loads the same files with nothing missing (vision included).
    _, vinfo = Qwen4ExpForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    if vinfo["missing_keys"] or vinfo["mismatched_keys"]:
        raise SystemExit(f"multimodal load: {vinfo}")

    pr = prompts(tok)
    rec = Recorder(model, cfg)
    meta: dict = {
        "generator": "scripts/golden/gen_flashnext_golden.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "python": sys.version.split()[0]},
        "precision": "f32 compute from the BF16 checkpoint weights; eager attention; 1 thread",
        "checkpoint": ckpt,
        "prompts": pr,
        "eos_token_id": EOS,
    }
    indexer_json = {}

    short = forward_prompt(model, rec, pr["short"]["ids"])
    t = len(pr["short"]["ids"])
    sets, scores = indexer_sets(short, t, cfg)
    indexer_json["short"] = sets
    save_tensors(golden / "short.safetensors", {**short["data"], **scores})

    long = forward_prompt(model, rec, pr["long"]["ids"])
    t = len(pr["long"]["ids"])
    sets, scores = indexer_sets(long, t, cfg)
    indexer_json["long"] = sets
    meta["residual_ratios"] = residual_ratios(long["data"], cfg)
    pos = torch.tensor(LONG_TRACE_POSITIONS)
    keep = {"positions": pos, "logits": long["data"]["logits"]}
    for key, v in long["data"].items():
        if key.endswith(("ple.ids", "topk_idx", "topk_w")):
            keep[key] = v
        elif key in ("embed", "mixer.out") or key.endswith((".in", ".after_attn", ".out")):
            keep[key] = v.index_select(0, pos)
    save_tensors(golden / "long.safetensors", {**keep, **scores})
    write_json(golden / "indexer.json", indexer_json, compact=True)

    rolls, roll_tensors = {}, {}
    for name, steps in (("short", SHORT_STEPS), ("long", LONG_STEPS)):
        r = rollout(model, rec, pr[name]["ids"], steps, cfg)
        roll_tensors[f"{name}.step_logits"] = r.pop("step_logits")
        rolls[name] = r
    write_json(golden / "rollouts.json", rolls, compact=True)
    save_tensors(golden / "rollouts.safetensors", roll_tensors)
    rec.close()

    meta["topk_emulation_checked"] = check_topk_emulation(args.topk_trials)
    cases = topk_vectors()
    for c in cases:
        em = emulate_topk(c["values"], c["k"])
        if set(em) != set(c["indices"]):
            raise SystemExit("topk emulation disagrees with a recorded vector")
    write_json(golden / "topk_ties.json", cases, compact=True)

    ties = {
        f"{p}.{layer}": {"positions_with_boundary_ties": len(v["ties"]),
                         "lowest_first_would_differ": len(v["lowest_first_differs"])}
        for p, layers in indexer_json.items() for layer, v in layers.items()
    }
    meta["indexer_ties"] = ties
    meta["rollouts"] = {n: {"steps": len(r["tokens"]), "min_margin": r["min_margin"],
                            "reprefill_max_abs_diff": r["reprefill_max_abs_diff"],
                            "reprefill_indexer_set_mismatches": len(r["reprefill_indexer_set_mismatches"]),
                            "decode_boundary_ties": len(r["decode_boundary_ties"])}
                        for n, r in rolls.items()}
    meta["files"] = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                           if p.is_file() and p.name != "REFERENCE_NOTES.md")
    meta["files"].append("golden/meta.json")
    write_json(golden / "meta.json", meta)
    for p in out.rglob("*"):
        if p.is_file():
            p.chmod(0o644)
    print(json.dumps({k: meta[k] for k in ("checkpoint", "indexer_ties", "rollouts")}, indent=1))
    for row in meta["residual_ratios"]:
        print(row)


if __name__ == "__main__":
    main()
