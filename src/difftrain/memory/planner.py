"""Predict peak GPU memory and host RAM of a training config before any weight is loaded.

Inputs are plain numbers a family hands over (``hints``): parameter counts
split by what the plan can do with them (fp8-eligible Linear/Conv weights,
the rest), the LoRA parameter count for the configured targets and rank, the
largest tensor, latent pixels per sample, and activation bytes per latent
pixel measured once per family on a GPU (stored as data next to the bundled
config). The estimate is a sum of named terms, so a user sees where the
memory goes, and the search tries the techniques that exist and ranks the
ones predicted to fit by a step-time cost measured on a GPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.schema import Config, EngineFSDP, WeightsInt4
from ..config.schema.memory import QUANTIZED_KINDS, QUANTIZED_WEIGHTS
from .card import LIBRARIES, card_terms
from .pinned import SLAB

GIB = 2**30
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: bytes a stored-rounded Linear weight takes (bitsandbytes' nf4 ~0.53 with its double-quantized scales; int4's
#: depend on its group: _part_bytes)
STORED_BYTES = {"fp8": 1, "nf4": 0.53, "int8": 1}
# optimizer state bytes per trained parameter, on the GPU and on the host
OPT_STATE = {"adamw": (8, 0), "adamw8bit": (2, 0), "adamw4bit": (1, 0), "adafactor": (4, 0), "cpu_offload": (0, 16)}
# relative step time of each choice (1.0 = no cost), from the GPU measurements in docs/benchmarks.md
SPEED = {
    "checkpoint": 1.6,
    "checkpoint_every_2": 1.35,
    "fp8": 1.2,
    "int4": 1.3,  # not measured: fp8's dequantization and the unpacking of two codes a byte
    # bitsandbytes' nf4 runs eager (its layers do not compile): Wan 14B LoRA 22.6 s/step against fp8 compiled 21.0
    # (H200, 2026-11-27): fp8's factor and that 8 %
    "nf4": 1.3,
    # checkpointed blocks' inputs in host RAM: their copies overlap the compute (Wan's recipes all use it); not
    # measured apart, so kept a little dearer than checkpoints on the GPU, which win where both fit
    "checkpoint_offload": 1.03,
    "cpu_offload": 1.6,
    "fused_backward": 1.0,
    "adamw8bit": 1.01,
    "adamw4bit": 1.05,
    "adafactor": 1.02,  # a step as cheap as AdamW's; a different optimizer, so AdamW wins where both fit
    "block_swap": 1.05,
    # DeepSpeed against the single-GPU way of the same job (docs/benchmarks.md): ZeRO-2 LoRA L12 0.60 s vs L1 0.58;
    # ZeRO-2 with the optimizer offloaded F6 1.63 vs torchao's offload F3 0.83; ZeRO-3 offloaded F7 2.38 vs F3; ZeRO-3
    # on 2 H200s 3.81 s vs one H100 with AdamW8bit 0.85 (issue 28)
    "zero2": 1.03,
    "zero2_offload": 1.96,
    "zero3_offload": 2.87,
    "zero3": 4.5,
    # several GPUs, each step against one GPU's sdxl-full (0.719 s, 2 H100s, issue 28): ZeRO-2 1.156 s, ZeRO-3 with
    # SDXL's tuned settings 1.647, FSDP2 eager 1.075 and 1.001 keeping the gathered weights from forward to backward.
    # Compiled (what speed auto gives a long run; 2 H200s, 2026-11-26) FSDP2 resharding took 0.620 s against 0.787
    # keeping the weights: a long run is the one that matters, so resharding ranks first (and holds less)
    "zero2_multi": 1.61,
    "zero3_tuned": 2.29,
    "fsdp": 1.35,
    "fsdp_keep": 1.39,
}  # block swap: 0.60 vs 0.58 s (LoRA), 0.96 vs 0.83 (full)  # 8-bit: a little slower, and an optional engine: loses ties
CUDA_CONTEXT_HOST_GIB = 1.5  # torch + CUDA libraries in host RAM, measured (anonymous RSS after load)
FILE_BYTES = 2  # checkpoints are distributed in fp16 / bf16
# a fused-backward step's temporaries, per element of the largest parameter, where the family has no measurement:
# its fp32 gradient, update, weight and rounding noise (SDXL's case F2: 740 MB for 29.5 M elements; CogVideoX-5b
# with Adafactor and block swap measured 8.97 GiB allocated where the plan without this term said 7.82)
FUSED_TEMP_BYTES = 25
# DeepSpeed's defaults as memory/deepspeed_engine.py leaves them: stage3_max_live_parameters (DeepSpeed's own
# default) and the reduce / prefetch bucket sizes difftrain sets (elements)
ZERO3_MAX_LIVE = 1e9
ZERO_BUCKET = 5e7
#: ZeRO on several GPUs without offload: what torch's allocator reserved past the allocated peak, in copies of the
#: whole bf16 weights, by stage (fitted to SDXL full on 2 H100s, issue 28: see _zero_shards)
ZERO_MULTI_RESERVED = {2: 1.35, 3: 1.6}
TRAINING_HOST_GIB = 0.4
# the allocator's least slack where a family has not measured its own: SD3 0.16-0.24 GiB and CogVideoX 0.31 (with
# expandable segments) over their smallest tiers on the H100
ALLOCATOR_SLACK_GIB = 0.15  # RSS added once training runs (batches, buffers): sdxl-lora-8gb 1.55 -> 2.06, sd3 +0.2


@dataclass
class Estimate:
    gpu: dict[str, float] = field(default_factory=dict)  # GiB by term
    host: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: GiB the caching allocator keeps beyond what is allocated, at the least (memory.json's allocator_slack_gib)
    slack: float = ALLOCATOR_SLACK_GIB
    #: memory.expandable_segments in effect (CogVideoX with them: 0.31 and 0.73 GiB slack at 3.8 and 7.2 GiB of
    #: activations, without: 1.19-1.97 at the same activations)
    expandable: bool = False
    #: GiB CUDA graphs' private memory pool holds beyond the allocated peak (where speed.graphs_possible)
    graph_pool: float = 0.0
    #: on the card beside torch's reservation: the CUDA context, the libraries, the display margin (card.py)
    card: dict[str, float] = field(default_factory=card_terms)
    #: the activations are not known for this mode (no measurement for the architecture): the totals leave them out,
    #: so a search must not call the config a fit
    unknown_activations: bool = False

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def gpu_reserved(self) -> float:
        """The caching allocator holds more than it hands out: a little (the family's, its memory.json), a few
        percent of what it hands out, and a share of the activations (their tensors come and go in many sizes).
        Fitted to the 16 tier recipes and the DeepSpeed cases measured on the H100 (docs/benchmarks.md, "Tiers as
        cards")."""
        share = 0.05 if self.expandable else 0.1  # expandable segments reuse the freed activations' pages
        return self.gpu_total * 1.04 + self.slack + share * self.gpu.get("activations", 0.0) + self.graph_pool

    @property
    def card_total(self) -> float:
        """What the card must hold: a tier's promise is that this stays under the card's GiB."""
        return self.gpu_reserved + sum(self.card.values())

    @property
    def free_needed(self) -> float:
        """What must be free on a GPU once this process has its CUDA context (what ``mem_get_info`` reports then):
        the reserved peak and the libraries still to load. The display's share is already out of that figure."""
        return self.gpu_reserved + self.card.get(LIBRARIES, 0.0)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


def estimate(cfg: Config, hints: dict, processes: int = 1) -> Estimate:
    """The peak of one process (one GPU) of ``processes`` training together (DDP, or DeepSpeed's shards)."""
    m, t = cfg.memory, cfg.train
    # whether CUDA graphs may be recorded (planning.plan_memory asks speed auto; else: named): their pool, block swap's
    # fixed slots and the compiled activations follow it
    hints = {**hints, "graphs": hints.get("graphs", cfg.speed.cuda_graphs is True)}
    e = Estimate(slack=hints.get("allocator_slack") or ALLOCATOR_SLACK_GIB, expandable=m.expandable)
    wk = m.weights.kind
    compute = m.weights.compute if isinstance(m.weights, QUANTIZED_WEIGHTS) else wk
    part_bytes, weights, trainable = _part_bytes(cfg, hints, compute)
    weights, swapped_bytes = _block_swap(cfg, hints, part_bytes, weights, e)
    if t.method == "lora":
        trainable = hints["lora_params"]
        weights += trainable * 4  # LoRA weights are kept in fp32
        grad_bytes = 4
    else:
        grad_bytes = BYTES[compute]
    e.gpu["weights"] = weights / GIB
    host_state = _gradients_and_optimizer(cfg, hints, trainable, grad_bytes, e, processes)
    if wk == "int8":
        e.notes.append(
            "bitsandbytes int8 measured 11.3 GiB on SDXL LoRA where this plan says 3.8 (its backward holds "
            "dequantized weights, docs/benchmarks.md): prefer memory.weights nf4 or fp8"
        )
    _activations(cfg, hints, e)
    e.gpu["workspace"] = hints.get("workspace", 0) / GIB
    if hints["graphs"] and hints.get("cuda_graph_pool"):
        # the recorded graphs' private pool: reserved beyond the allocated peak (which graphs did not raise), shared
        # by every shape's graphs, so it stays bounded as shapes are added
        e.graph_pool = hints["cuda_graph_pool"]
        if m.offload.kind == "block_swap" and hints.get("swap_units"):
            # with block swap only the blocks' forward is recorded (its hooks stay outside): measured on the H100
            # (2026-11-26), the pool added 0.09 GiB (sdxl-lora-3gb, one shape) and 0.14 (sdxl-lora-4gb, six shapes)
            # to the reserved peak, against 0.3 without block swap
            e.graph_pool *= 0.5
        e.notes.append(
            f"CUDA graphs (speed auto or named): their memory pool adds ~{e.graph_pool:.2f} GiB to the reserved "
            "peak (measured over six SDXL buckets); speed.cuda_graphs: false saves it"
        )
    # host (peak RSS; issue 23 measured the tier recipes, docs/benchmarks.md "Tiers as cards")
    e.host["libraries"] = CUDA_CONTEXT_HOST_GIB
    e.host["training (batches, buffers)"] = TRAINING_HOST_GIB
    parts = hints["parts"]
    if cfg.model.path is not None and Path(cfg.model.path).is_dir():
        # a diffusers folder's models are read by difftrain's SafetensorsReader like a single file (private reads,
        # families.common.read_diffusers_model); transformers' text encoders, and the denoiser of ZeRO-3's
        # partitioned build (and FSDP's sharded one), through safetensors' mapping: their pages count while they
        # are loaded
        e_ = m.engine
        zero3 = (e_.kind == "deepspeed" and e_.stage == 3 and cfg.train.method == "full") or e_.kind == "fsdp"
        mapped = [
            name
            for name, p in parts.items()
            if p.get("loaded", True) and (name.startswith("text_encoder") or (zero3 and name == hints.get("denoiser")))
        ]
        if mapped:
            e.host["reading the checkpoint (file pages)"] = sum(parts[x]["total"] for x in mapped) * FILE_BYTES / GIB
    if m.optimizer.kind == "cpu_offload":
        # torchao keeps a pinned host copy of each weight and of its gradient and AdamW's two moments, all in the
        # weight's dtype (sdxl-full-8gb: 24.1 GiB RSS with each copy rounded up to a power of two, before packing)
        e.host["optimizer state"] = 4 * trainable * BYTES[compute] / GIB
    else:
        e.host["optimizer state"] = trainable * host_state / GIB
    if swapped_bytes:
        e.host["swapped blocks (pinned)"] = swapped_bytes / GIB
    if swapped_bytes or m.optimizer.kind == "cpu_offload":
        # pinned copies are packed into slabs (memory/pinned.py): on average half a slab is left unused
        e.host["pinned slabs' free tail"] = SLAB / 2 / GIB
    if wk in QUANTIZED_KINDS or m.offload.kind == "block_swap":
        # the streaming load (memory/placement.py): each tensor read is stored where it lives (fp8, nf4, int8 or int4 on the
        # GPU, the pinned store) before the next is read: the one read and the copy being made of it (issue 50)
        e.host["load (one tensor at a time)"] = 2 * hints.get("largest_param", 0) * BYTES[compute] / GIB
    if cfg.ema.enabled and cfg.ema.device == "cpu":
        e.host["EMA"] = trainable * 4 / GIB
    elif cfg.ema.enabled:
        e.gpu["EMA"] = trainable * 4 / GIB
    return e


def _part_bytes(cfg: Config, hints: dict, compute: str) -> tuple[dict[str, float], float, int]:
    """(weight bytes of each loaded part, their sum, parameters a full fine-tune trains)."""
    wk, t = cfg.memory.weights.kind, cfg.train
    trained_parts = hints["trained_parts"]
    weights = 0.0
    trainable = 0
    part_bytes: dict[str, float] = {}
    for name, p in hints["parts"].items():
        if not p.get("loaded", True):
            continue
        full_trained = t.method == "full" and name in trained_parts
        if wk in QUANTIZED_KINDS and not full_trained:
            # fp8: Linear and Conv2d; bitsandbytes and int4: Linear only (nf4 ~0.53 bytes with double-quantized
            # scales; int4 half a byte and a scale and zero point in the compute dtype per group)
            q = p["fp8_eligible"] if wk == "fp8" else p.get("linear", p["fp8_eligible"])
            group = cfg.memory.weights.group_size if isinstance(cfg.memory.weights, WeightsInt4) else 1
            per = {**STORED_BYTES, "int4": 0.5 + 2 * BYTES[compute] / group}[wk]
            part_bytes[name] = q * per + (p["total"] - q) * BYTES[compute]
        else:
            part_bytes[name] = p["total"] * BYTES[compute]
        weights += part_bytes[name]
        if full_trained:
            trainable += p["total"]
    return part_bytes, weights, trainable


def _block_swap(
    cfg: Config, hints: dict, part_bytes: dict[str, float], weights: float, e: Estimate
) -> tuple[float, float]:
    """(weight bytes on the GPU once block swap has moved its blocks out, bytes of the blocks in host RAM)."""
    m = cfg.memory
    swapped_bytes = 0.0
    if m.offload.kind == "block_swap" and hints.get("swap_units"):
        # the N largest units live in host RAM (as BlockSwap picks them); prefetch + 1 of them are on the GPU at a time
        den = hints["denoiser"]
        per_param = part_bytes[den] / hints["parts"][den]["total"]
        sizes = hints["swap_units"]
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], -i))[: m.offload.blocks_to_swap]
        swapped_bytes = sum(sizes[i] for i in order) * per_param
        # the peak is where backward starts (the most activations saved): the units on the GPU then are the last
        # prefetch + 1 in forward order, where they are swapped ones (measured on the H100: SDXL's peak over its
        # loaded weights is the same with and without block swap, 0.85-0.89 GiB, as its last units are small or
        # not swapped; SD3's is 0.30 GiB higher, its last two blocks)
        tail = set(range(len(sizes) - m.offload.prefetch - 1, len(sizes)))
        if cfg.train.method == "full" and m.fused_backward and den in hints["trained_parts"]:
            # stepped on the GPU in backward and copied home (write-back): what the family measured the caching
            # allocator holding beyond its usual slack then (its memory.json's write_back_slack_gib: Flux's, with
            # every block swapped; SDXL's and CogVideoX's, with part of them, fit without it)
            e.slack += hints.get("write_back_slack", 0.0)
        in_flight = sum(sizes[i] for i in order if i in tail) * per_param
        if hints["graphs"] and order:
            # with CUDA graphs (named, or auto where nothing rules them out) the blocks land in fixed slots
            # (block_swap.py): prefetch + 2 of the largest swapped block, held for the whole run
            in_flight = min(m.offload.prefetch + 2, len(order)) * max(sizes[i] for i in order) * per_param
        # a block that is not checkpointed keeps its weights alive (saved for backward) until its backward
        kept = 1 - 1 / m.activations.every if m.activations.kind == "checkpoint" else 1.0
        weights -= swapped_bytes * (1 - kept) - in_flight
    elif m.offload.kind == "block_swap":
        e.notes.append("no block list for this architecture: block swap not counted")
    return weights, swapped_bytes


def _gradients_and_optimizer(
    cfg: Config, hints: dict, trainable: int, grad_bytes: int, e: Estimate, processes: int = 1
) -> int:
    """The gradient and optimizer state terms (DeepSpeed's among them); returns the optimizer state's bytes per
    trained parameter in host RAM. On several processes: DDP's gradient buckets, DeepSpeed's shards."""
    m = cfg.memory
    if processes > 1 and m.engine.kind in ("auto", "single", "ddp"):
        # DDP all-reduces flat bucket copies of the gradients (gradient_as_bucket_view is off): a second copy of
        # them on each GPU (torch's documentation of gradient_as_bucket_view; not measured here)
        e.gpu["DDP gradient buckets"] = trainable * grad_bytes / GIB
    if m.fused_backward:
        # one gradient at a time in principle; measured: gradients and optimizer temporaries in flight
        extra = hints.get("fused_backward_extra") or FUSED_TEMP_BYTES * hints["largest_param"]
        e.gpu["gradients"] = (hints["largest_param"] * grad_bytes + extra) / GIB
    elif m.optimizer.kind == "cpu_offload" and m.optimizer.offload_gradients:
        e.gpu["gradients"] = hints["largest_param"] * grad_bytes * 2 / GIB  # in flight to the host
    else:
        e.gpu["gradients"] = trainable * grad_bytes / GIB
    gpu_state: float  # bytes per trained parameter on this GPU (ZeRO's share of them on several)
    gpu_state, host_state = OPT_STATE[m.optimizer.kind]
    if m.engine.kind == "deepspeed":
        # ZeRO keeps fp32 master weights and AdamW moments (12 bytes) with the optimizer, plus an fp32
        # gradient partition where the step runs; the model's weights and gradients are bf16
        e_ = m.engine
        gpu_state, host_state = (0, 16) if e_.offload_optimizer_device != "none" else (16, 0)
        e.gpu["gradients"] = trainable * 2 / GIB
        if e_.stage == 3 and e_.offload_param_device != "none":
            # weights fetched layer by layer and kept while DeepSpeed's live-parameter budget allows
            # (stage3_max_live_parameters, 1e9 by default) plus a prefetch bucket; gradients leave for the host
            # through a reduce bucket as each layer's backward ends (SDXL full, H100: 2.83 GiB allocated, this 2.83)
            numel = e.gpu["weights"] * GIB / 2
            resident = min(numel, ZERO3_MAX_LIVE) * 2 + ZERO_BUCKET * 2
            e.host["weights (ZeRO-3 offload)"] = e.gpu["weights"] - resident / GIB
            e.gpu["weights"] = resident / GIB
            e.gpu["gradients"] = (hints["largest_param"] + ZERO_BUCKET) * 2 / GIB
        elif e_.stage == 2 and e_.offload_optimizer_device != "none":
            # ZeRO-2 with the optimizer on the CPU: torch's allocator held about the weights again beyond the
            # allocated peak (SDXL full, H100: 14.75 GiB reserved for 9.63 allocated; with expandable segments, with
            # overlap_comm off, and with the cache emptied after DeepSpeed's set-up alike); whether a card's cap
            # reclaims it is not measured
            e.slack += e.gpu["weights"]
        if processes > 1:
            _zero_shards(e, e_, processes, trainable, hints)
            gpu_state /= processes  # stages 2 and 3 keep each process's shard of the optimizer state
        e.notes.append(
            "DeepSpeed's terms are fitted to three SDXL cases on one GPU (docs/benchmarks.md); its host RAM with the "
            "optimizer offloaded was measured 35 % above this plan's"
            + (f"; the shards over {processes} GPUs are ZeRO's arithmetic, not measured" if processes > 1 else "")
        )
    if m.engine.kind == "fsdp":
        gpu_state = _fsdp_terms(cfg, hints, trainable, e, processes)
    e.gpu["optimizer state"] = trainable * gpu_state / GIB
    if m.optimizer.kind == "adafactor" and cfg.train.method == "full":
        # fp32 factored second moments: a row and a column vector for each matrix (families/common.py)
        parts = hints["parts"]
        factored = sum(parts[p].get("adafactor_state", parts[p]["total"]) for p in hints["trained_parts"] if p in parts)
        e.gpu["optimizer state"] = factored * 4 / GIB
    return host_state


def _fsdp_terms(cfg: Config, hints: dict, trainable: int, e: Estimate, processes: int) -> float:
    """FSDP2 (memory.engine fsdp, full fine-tunes): what each of ``processes`` GPUs holds, by FSDP's arithmetic
    (SDXL full on 2 H100s: 20.0 GiB allocated / 22.3 reserved, planned 20.4 / 21.6; keeping the gathered
    weights 20.4 / 27.1, planned 24.9 / 26.3): its share of the master weights and gradients (fp32, or bf16) and of
    AdamW's moments (fp32, or torchao's 8 or 4 bits), plus the units gathered whole in the compute dtype (the root,
    the block computing and the one prefetched; every block between forward and backward with reshard_after_forward
    false) and a block's unsharded gradients in flight to the reduce-scatter. Returns the optimizer state's bytes per trained parameter on this GPU."""
    e_ = cfg.memory.engine
    assert isinstance(e_, EngineFSDP)
    n = processes
    den = hints["denoiser"]
    numel = hints["parts"][den]["total"]
    units = hints.get("swap_units") or [hints["largest_param"]]
    compute = 2 if cfg.train.mixed_precision == "bf16" else 4
    root = max(numel - sum(units), 0)
    largest = max(units)
    gathered = root + 2 * largest if e_.reshard_after_forward else numel
    master = 2 if e_.master_dtype == "bf16" else 4
    # AdamW's two moments: torch's in fp32; torchao's in 8 or 4 bits (a scale per block of 256 or 128 beside them)
    moments = {"adamw8bit": 2 + 8 / 256, "adamw4bit": 1 + 8 / 128}.get(cfg.memory.optimizer.kind, 8.0)
    shares = {"weights": numel * master / n, "gradients": trainable * master / n, "optimizer": trainable * moments / n}
    e.gpu["weights"] = gathered * compute / GIB
    e.gpu["gradients"] = largest * (compute + 4) / GIB
    if e_.offload_params:
        e.host["FSDP shares (weights, gradients, AdamW)"] = sum(shares.values()) / GIB
        state = 0.0
    else:
        e.gpu["weights"] += shares["weights"] / GIB
        e.gpu["gradients"] += shares["gradients"] / GIB
        state = moments / n
    e.notes.append(
        "FSDP's terms are its sharding arithmetic, checked on SDXL full over 2 H100s (reserved within 4 %)"
        + (f"; over {n} processes they are not measured" if n > 2 else "")
        + ("; its shares in host RAM are not measured on GPUs" if e_.offload_params else "")
    )
    return state


def _zero_shards(e: Estimate, e_: Any, processes: int, trainable: int, hints: dict) -> None:
    """What ZeRO divides among ``processes`` GPUs (its paper's arithmetic): the optimizer state (stages 2 and 3), the
    bf16 gradients past a reduce bucket (stage 2 and 3), and at stage 3 the weights past what is gathered live."""
    n = processes
    if e_.offload_optimizer_device == "none" and e_.offload_param_device == "none":
        # the allocator's hold past the allocated peak, on several GPUs without offload, in copies of the whole bf16
        # weights (SDXL full on 2 H100s, 4.8 GiB of them: ZeRO-2 35.0 GiB reserved for 28.8 allocated, ZeRO-3 with
        # SDXL's tuned settings 35.9 for 26.75, with DeepSpeed's own 33.2; the last is over-counted by ~2.6 GiB)
        e.slack += e.gpu["weights"] * ZERO_MULTI_RESERVED[e_.stage]
    e.gpu["gradients"] = min(e.gpu["gradients"], (trainable * 2 / n + ZERO_BUCKET * 2) / GIB)
    if e_.stage == 3 and e_.offload_param_device == "none":
        numel = e.gpu["weights"] * GIB / 2
        live = min(numel, ZERO3_MAX_LIVE) * 2 + ZERO_BUCKET * 2
        e.gpu["weights"] = min(e.gpu["weights"], (numel * 2 / n + live) / GIB)


#: compiled (checkpointed) blocks' activations against the eager figures (see _activations)
COMPILED_ACTIVATIONS = 0.9


def _activations(cfg: Config, hints: dict, e: Estimate) -> None:
    """The activations term: bytes per latent pixel measured for the checkpointing mode, times the batch's pixels."""
    m, t = cfg.memory, cfg.train
    act = hints["activations"]
    mode = "none" if m.activations.kind == "none" else "checkpoint"
    if m.activations.kind == "checkpoint" and m.activations.split and "checkpoint_split" in act:
        mode = "checkpoint_split"  # blocks recomputed as segments (measured apart where the family has them)
    if mode not in act:
        e.notes.append(f"no activation measurement for this architecture ({mode}); activations not counted")
        e.unknown_activations = True
        per_pixel = 0.0
    else:
        per_pixel = act[mode]
        # the kind, not the mode: the same test (two kinds), and mypy then knows the config has `every`
        if m.activations.kind == "checkpoint" and m.activations.every > 1:
            # between all-checkpointed and none, in proportion to the blocks left unchecked
            if "none" not in act:  # (Wan: every block checkpointed is all that was measured)
                e.notes.append(
                    "no activation measurement for this architecture without checkpointing; the blocks left "
                    f"unchecked by every: {m.activations.every} not counted"
                )
                e.unknown_activations = True
            per_pixel += (act.get("none", per_pixel) - per_pixel) * (1 - 1 / m.activations.every)
    pixels = hints["latent_pixels"] * t.batch_size
    e.gpu["activations"] = per_pixel * pixels / GIB
    if hints["graphs"] and mode == "checkpoint":
        # compiled checkpointed blocks hold less at the peak than the eager ones the figures were measured on; counted
        # only where CUDA graphs may be recorded, whose pool and block swap slots outweigh it when a short run stays
        # eager. Measured on the H100 (2026-11-25/26): SDXL 1024 LoRA 5.85 -> 5.77 GiB (sdxl-lora-8gb), 1.136 ->
        # 1.07 (sdxl-lora-3gb, compiled without graphs), SD3 1.252 -> 1.17 (sd3-lora-4gb): 9-11 % of the activations
        e.gpu["activations"] *= COMPILED_ACTIVATIONS
    if m.activations.kind == "checkpoint" and m.activations.save_attention:
        # each checkpointed block also keeps its attentions' outputs (the family states their bytes per latent pixel,
        # all blocks together; every k-th block checkpointed: a k-th of them)
        if "attention_output_bytes" in hints:
            kept = hints["attention_output_bytes"] * pixels / m.activations.every / GIB
            e.gpu["activations"] += kept
        else:
            e.notes.append("no figure for the attentions' outputs that save_attention keeps; not counted")
            e.unknown_activations = True
    if m.activations.kind == "checkpoint" and m.activations.offload:
        # the checkpointed blocks' inputs wait in host RAM (the family states their bytes per latent pixel; none
        # stated: nothing is counted as moved, the safe side on the GPU)
        moved = hints.get("checkpoint_input_bytes", 0) * pixels / m.activations.every / GIB
        if m.activations.keep_on_gpu:  # the last blocks' inputs stay on the GPU (the family states its block count)
            blocks = hints.get("checkpoint_blocks", 0)
            moved *= max(0, blocks - m.activations.keep_on_gpu) / blocks if blocks else 0.0
        e.gpu["activations"] -= min(moved, e.gpu["activations"])  # without activation data: nothing to take from
        e.host["checkpoints (offloaded, pinned)"] = moved
    if hints.get("encode_captions"):
        e.gpu["activations"] += hints.get("text_encoder_activations", 0) * t.batch_size / GIB


def speed_cost(cfg: Config, processes: int = 1, zero3_tuned: bool = False) -> float:
    """A config's step time against the unconstrained run's (SPEED's factors multiplied), on ``processes`` GPUs:
    what plan's search ranks the configs that fit by. ``zero3_tuned``: the family has measured ZeRO-3 settings."""
    m = cfg.memory
    c = 1.0
    if m.activations.kind == "checkpoint":
        c *= SPEED["checkpoint"] if m.activations.every == 1 else SPEED["checkpoint_every_2"]
        if m.activations.offload:
            c *= SPEED["checkpoint_offload"]
    if m.weights.kind in ("fp8", "int4", "nf4"):
        c *= SPEED[m.weights.kind]
    c *= SPEED.get(m.optimizer.kind, 1.0)
    if m.offload.kind == "block_swap":
        c *= SPEED["block_swap"]
    e = m.engine
    if e.kind == "deepspeed":
        offloaded = e.offload_optimizer_device != "none" or e.offload_param_device != "none"
        key = f"zero{e.stage}{'_offload' if offloaded else ''}"
        if key == "zero2" and processes > 1:
            key = "zero2_multi"
        if key == "zero3" and e.family_settings and zero3_tuned:
            key = "zero3_tuned"
        c *= SPEED[key]
    if e.kind == "fsdp":
        c *= SPEED["fsdp" if e.reshard_after_forward else "fsdp_keep"]
    return c


#: Peak memory of an image VAE's encoder (SDXL's, SD3's and Flux's share the layout) per pixel of its batch, over its
#: weights and input: 3.01 GiB in fp32 and 1.51 in bf16 for one 1024x1024 image, linear in the batch (1, 2, 4) and
#: in the pixels (832x1216: 2.90 / 1.46), the same for the three VAEs; torch's allocator reserved up to 1.5x it
#: (H100, benchmarks/vae_encode.py --peaks, 2026-11-25). precompute.batch_size 4 in fp32 needs ~12 GiB, so on a small
#: card precompute cuts the batch to what fits (an 8 GB card: one image in fp32, two in bf16).
VAE_ENCODE_BYTES_PER_PIXEL = {"fp32": 3080, "bf16": 1546, "fp16": 1546}
VAE_RESERVE_FACTOR = 1.5

#: parameters of the image VAE (the SDXL, SD3 and Flux AutoencoderKL, encoder and decoder: 83.7 M), loaded whole
VAE_PARAMS = 83.7e6


#: torch's reserved peak of precompute's T5-XXL stage (4.76 B parameters) by precision: loaded through
#: bitsandbytes as precompute does, 4 captions of 256 tokens (NVIDIA H200, 2026-11-21: docs/benchmarks.md, "SD3
#: caption precompute"; 77 tokens 0.1-0.2 GiB less). fp32 is bf16's twice, not measured.
T5_PRECOMPUTE_GIB = {"int8": 5.96, "nf4": 4.39, "bf16": 9.22, "fp16": 9.22, "fp32": 18.4}

#: A language model as the text encoder (Z-Image's Qwen3, Qwen-Image's Qwen2.5-VL, FLUX.2's Qwen3 or Mistral 3):
#: precompute's stage estimated from its parameters, not measured. Its Linear weights at the precision's bytes
#: (bitsandbytes: int8 1, nf4 0.53 with its double-quantized scales; the output embedding is not quantized), the other
#: parameters at precompute.text_encoder_dtype's, plus what T5-XXL's measured stage held beyond the same arithmetic
#: on its own 4.63 B Linear and 0.13 B other elements (T5_PRECOMPUTE_GIB less 4.56, 2.53 and 8.87 GiB): the CUDA and
#: bitsandbytes workspaces, the activations of a batch of captions, the allocator's slack
LLM_QUANT_BYTES = {**BYTES, **STORED_BYTES}  # by text_encoders.llm.precision
LLM_MARGIN_GIB = {"int8": 1.40, "nf4": 1.86, "bf16": 0.35, "fp16": 0.35, "fp32": 0.70}


def llm_stage_gib(linear: int, other: int, precision: str, other_bytes: float) -> float:
    """GiB of a text encoder's precompute stage: ``linear`` Linear-weight elements at ``precision``'s bytes, ``other``
    elements at ``other_bytes`` each, and the margin T5-XXL's measured stage held (LLM_MARGIN_GIB)."""
    return (linear * LLM_QUANT_BYTES[precision] + other * other_bytes) / GIB + LLM_MARGIN_GIB[precision]


def vae_chunk(batch_size: int, vae_dtype: str, pixels: int, room: float) -> int:
    """How many images of ``pixels`` pixels to encode at once within ``room`` bytes (at least one, at most the
    configured batch), with the allocator's measured overshoot and a tenth kept free."""
    need = VAE_ENCODE_BYTES_PER_PIXEL[vae_dtype] * pixels * VAE_RESERVE_FACTOR
    return max(1, min(batch_size, int(0.9 * room // need)))


def candidates(cfg: Config, swap_units: int = 0, processes: int = 1, offload_blocks: int = 0) -> list[dict]:
    """Overrides worth trying, as nested dicts (each validated before use).

    ``swap_units``: how many blocks the denoiser has for block swap (0: none tried). ``offload_blocks``: how many
    blocks' checkpointed inputs may wait in host RAM (the family states their bytes: Wan; 0: not tried), each with
    the last 0, 2, 4 or 8 of them kept on the GPU. On several ``processes`` a full fine-tune also tries the sharded
    engines, FSDP and DeepSpeed's ZeRO stages (bf16 weights, AdamW).
    """
    full = cfg.train.method == "full"
    weights = [{"kind": "bf16"}] if full else [{"kind": "bf16"}, {"kind": "fp8"}, {"kind": "nf4"}]
    # a config that offloads its checkpoints keeps doing so under a candidate of the same kind (the loader merges):
    # the candidates on the GPU say so
    on_gpu: dict[str, Any] = (
        {"offload": False, "keep_on_gpu": 0} if getattr(cfg.memory.activations, "offload", False) else {}
    )
    acts = [
        {"kind": "none"},
        {"kind": "checkpoint", "every": 2, **on_gpu},
        {"kind": "checkpoint", "every": 1, **on_gpu},
    ]
    acts += [
        {"kind": "checkpoint", "every": 1, "offload": True, "keep_on_gpu": k}
        for k in (0, 2, 4, 8)
        if offload_blocks and k < offload_blocks
    ]
    opts: list[dict[str, Any]] = [{"kind": "adamw"}, {"kind": "adamw8bit"}]
    extra: list[dict[str, bool]] = [{}]
    if full:
        opts += [{"kind": "cpu_offload", "offload_gradients": True}, {"kind": "adafactor"}]
        extra.append({"fused_backward": True})
    offloads: list[dict[str, Any]] = [{"kind": "none"}]
    if swap_units:  # half or all of the blocks in host RAM
        offloads += [
            {"kind": "block_swap", "blocks_to_swap": max(1, swap_units // 2)},
            {"kind": "block_swap", "blocks_to_swap": swap_units},
        ]
    out = []
    for w, a, o, x, off in itertools.product(weights, acts, opts, extra, offloads):
        if x and o["kind"] == "cpu_offload":
            continue
        mem = {"weights": w, "activations": a, "optimizer": o, **x}
        if off["kind"] != "none":
            mem["offload"] = off
        train = {"max_grad_norm": None} if (x or o["kind"] == "cpu_offload") else {}
        out.append({"memory": mem, "train": train} if train else {"memory": mem})
    if processes > 1 and full:
        for eng, a in itertools.product(SHARDED_ORDER, acts):
            # the whole of what the engine needs beside it: a recipe's fused backward or block swap would be refused
            out.append({"memory": {**sharded_memory(eng), "activations": a}, "train": {"mixed_precision": "bf16"}})
    return out


#: the sharded engines tried for a full fine-tune on several GPUs (engine auto, in this order; plan's search), the
#: fastest first as measured on 2 GPUs, SDXL full 1024 px, batch 1 per GPU (docs/benchmarks.md, issue 28): torch's
#: FSDP2 with each block's forward compiled (speed auto's choice for a long run) 3.22 samples/s resharding after
#: forward, 2.54 keeping the gathered weights until backward (2 H200s); eager (2 H100s) 1.86 and 2.00, DeepSpeed
#: ZeRO-2 with its optimizer on the GPU 1.73, ZeRO-3 1.21 (with the family's tuned settings; 0.67 untuned). FSDP
#: also holds less per GPU than ZeRO-2 (20.0 against 28.8 GiB allocated), resharding less than keeping. Then what
#: frees more memory at more cost: the optimizer offloaded before the weights. FSDP with its shares in host RAM is
#: not measured on GPUs: auto does not pick it.
SHARDED_ORDER: tuple[dict, ...] = (
    {"kind": "fsdp", "reshard_after_forward": True},
    {"kind": "fsdp", "reshard_after_forward": False},
    {"kind": "deepspeed", "stage": 2, "offload_optimizer_device": "none"},
    {"kind": "deepspeed", "stage": 2, "offload_optimizer_device": "cpu"},
    {"kind": "deepspeed", "stage": 3, "offload_optimizer_device": "none"},
    {"kind": "deepspeed", "stage": 3, "offload_optimizer_device": "cpu"},
    {"kind": "deepspeed", "stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"},
)


def sharded_memory(engine: dict) -> dict:
    """memory fields for a sharded ``engine`` (DeepSpeed or FSDP) with what it needs beside it (config/schema/root.py's
    _deepspeed and _fsdp): an AdamW (DeepSpeed's own, or torch's over the shares), bf16 weights, no fused backward
    or block swap."""
    return {
        "engine": engine,
        "optimizer": {"kind": "adamw"},
        "weights": {"kind": "bf16"},
        "fused_backward": False,
        "offload": {"kind": "none"},
    }


def as_set_lines(override: dict, prefix: str = "") -> list[str]:
    lines = []
    for k, v in override.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and "kind" in v:
            inner = ", ".join(f"{a}: {str(b).lower() if isinstance(b, bool) else b}" for a, b in v.items())
            lines.append(f"--set '{key}={{{inner}}}'")
        elif isinstance(v, dict):
            lines += as_set_lines(v, key + ".")
        else:
            lines.append(f"--set {key}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}")
    return lines
