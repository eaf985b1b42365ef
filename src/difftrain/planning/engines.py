"""memory.engine ``auto`` on several processes: which engine trains a config (DDP where a replica fits, else the
fastest sharded engine that fits, in the measured order), what a launch cannot train, and the scaling measured
for the choice."""

from __future__ import annotations

from ..config.schema import Config
from ..families.registry import get_family
from .estimate import plan_memory


def _with(cfg: Config, memory: dict, train: dict | None = None) -> Config | None:
    """``cfg`` with these memory (and train) fields, validated again; None where the validator refuses the pair."""
    return _with_why(cfg, memory, train)[0]


def _with_why(cfg: Config, memory: dict, train: dict | None = None) -> tuple[Config | None, str | None]:
    """:func:`_with`, and the validator's reason where it refuses."""
    from pydantic import ValidationError

    data = cfg.model_dump(mode="python")
    data["memory"].update(memory)
    if train:
        data["train"].update(train)
    try:
        return Config.model_validate(data), None
    except ValidationError as err:
        from ..config.load import validation_problems

        return None, validation_problems(err)[0][1]  # the first problem, as the config's own errors say it


def choose_engine(
    cfg: Config, processes: int, gpu_gib: float | None, recorded: dict | None = None
) -> tuple[Config, str | None]:
    """memory.engine ``auto`` resolved for ``processes`` processes on GPUs of ``gpu_gib`` (None: no CUDA GPU), and
    the line that says why (None: nothing to say). ``recorded``: the engine a resumed checkpoint was made with.
    Another engine named in the config is kept as it is; the config returned never says ``auto``."""
    from ..config.schema import EngineDDP, EngineDeepSpeed, EngineFSDP, EngineSingle
    from ..memory.planner import SHARDED_ORDER, sharded_memory
    from ..runtime.distributed import engine_problem

    if cfg.memory.engine.kind != "auto":
        return cfg, None
    single = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"engine": EngineSingle()})})
    if recorded is not None and recorded.get("kind") == "fsdp":  # its checkpoint holds FSDP's optimizer state
        fsdp = _with(cfg, {"engine": EngineFSDP.model_validate(recorded).model_dump()})
        if fsdp is None:
            from ..errors import ConfigError

            raise ConfigError(
                "The checkpoint resumed was made with memory.engine fsdp, which this config cannot train with.",
                hint="Resume with the config saved in the checkpoint folder (config.yaml): memory.engine fsdp "
                "trains full fine-tunes with memory.optimizer.kind adamw.",
            )
        return fsdp, "engine auto: FSDP, as the checkpoint resumed was made"
    if recorded is not None and recorded.get("kind") == "deepspeed":
        engine = EngineDeepSpeed.model_validate(recorded)
        kept = _with(cfg, sharded_memory(engine.model_dump(mode="python")), {"mixed_precision": "bf16"})
        if kept is not None:
            return kept, f"engine auto: DeepSpeed ZeRO-{engine.stage}, as the checkpoint resumed was made"
    if processes < 2:
        return single, None
    problem = engine_problem(cfg, processes)  # auto is checked as DDP would run it
    ddp = None if problem else _with(cfg, {"engine": EngineDDP().model_dump()})
    if ddp is not None and recorded is not None:  # torch's optimizer state: DDP reads it on any process count
        return ddp, "engine auto: DDP, as the checkpoint resumed was made (torch's optimizer state)"
    if ddp is not None and gpu_gib is None:
        return ddp, "engine auto: DDP (no CUDA GPU to weigh the plan against)"
    ddp_card = plan_memory(ddp, processes).card_total if ddp is not None else None
    if ddp is not None and ddp_card is not None and gpu_gib is not None and ddp_card <= gpu_gib:
        return ddp, f"engine auto: DDP: a replica fits each GPU ({ddp_card:.1f} of {gpu_gib:.0f} GiB planned)"
    if ddp_card is not None:
        why = f"a replica does not fit ({ddp_card:.1f} GiB planned per GPU of {gpu_gib:.0f})"
    else:
        why = f"DDP cannot train it ({(problem or '').rstrip('.')})"
    if cfg.train.method == "full" and gpu_gib is not None and recorded is None:
        fsdp_refused = None  # why FSDP, the fastest sharded engine measured, cannot train this config
        for z in SHARDED_ORDER:
            c, refused = _with_why(cfg, sharded_memory(z), {"mixed_precision": "bf16"})
            if c is None:  # what this engine refuses in the config (FSDP: EMA, validation prompts, ...)
                fsdp_refused = fsdp_refused or (refused if z["kind"] == "fsdp" else None)
                continue
            card = plan_memory(c, processes).card_total
            if card <= gpu_gib:
                replaced = cfg.memory.optimizer.kind != "adamw"
                return c, (
                    f"engine auto: {_engine_words(z)}: {why}; this is planned at {card:.1f} GiB"
                    + (f" (AdamW replaces memory.optimizer {cfg.memory.optimizer.kind})" if replaced else "")
                    + (f"; FSDP, faster, was not taken: {fsdp_refused}" if fsdp_refused and z["kind"] != "fsdp" else "")
                )
    if ddp is None:  # what DDP cannot train: said by the caller (distributed.engine_problem) with what to do
        return single, None
    return ddp, f"engine auto: DDP, though nothing is planned to fit {gpu_gib:.0f} GiB per GPU: {why}"


def _engine_words(z: dict) -> str:
    """A sharded engine of planner.SHARDED_ORDER in the words of engine auto's line."""
    if z["kind"] == "fsdp":
        keep = "" if z.get("reshard_after_forward", True) else ", each block's weights kept from forward to backward"
        return f"FSDP (torch's sharding{keep}; measured faster than DeepSpeed's ZeRO on SDXL)"
    off = " with the optimizer in host RAM" if z["offload_optimizer_device"] != "none" else ""
    off += " and the weights" if z.get("offload_param_device") == "cpu" else ""
    return f"DeepSpeed ZeRO-{z['stage']}{off}"


def launch_problem(cfg: Config, processes: int) -> str | None:
    """What the launcher of ``processes`` processes refuses before any starts: what DDP cannot train
    (distributed.engine_problem), unless engine auto can still shard it (a full fine-tune on CUDA GPUs,
    whose processes choose once they see their GPU)."""
    import torch

    from ..runtime.distributed import engine_problem

    problem = engine_problem(cfg, processes)  # auto is checked as DDP would run it
    if problem and cfg.memory.engine.kind == "auto":
        zero_possible = cfg.train.method == "full" and cfg.train.device != "cpu" and torch.cuda.is_available()
        return None if zero_possible else problem
    return problem


def expected_scaling(cfg: Config, processes: int) -> str | None:
    """What is measured about each GPU's throughput on ``processes`` GPUs against one GPU, for the engine ``cfg``
    names (engine auto resolved first): one line for ``plan --gpus N``, None on one process. The figures are
    docs/benchmarks.md's ("Several GPUs", issue 28): SDXL at 1024x1024, batch 1 per GPU, each GPU's samples/s
    against the best single-GPU recipe of the same job (for a full fine-tune: sdxl-full, 8-bit AdamW, 1.39
    samples/s on an H100); a family or job not measured is said to be so rather than guessed."""
    if processes < 2:
        return None
    e = cfg.memory.engine
    lora = cfg.train.method == "lora"
    if e.kind == "ddp":
        if lora:
            return (
                "expected per GPU: ~0.8-1.0x one GPU's samples/s (measured, SDXL LoRA r16 on DDP at 2 GPUs: 81 % on "
                "H100s, 86-98 % on H200s; 94 % at 4; a LoRA's gradients are a few MB, its eager step is host-bound)"
            )
        return (
            "expected per GPU: ~0.9-1.0x one GPU's samples/s (measured, SDXL full with 8-bit AdamW on DDP: 0.90x at 2 "
            "H100s eager; on 2 H200s 0.97x eager, and 0.99x compiled with CUDA graphs against one GPU compiled with "
            "them, as speed auto runs a long job; its all-reduce carries every weight's gradient each step)"
        )
    if e.kind == "deepspeed" and e.stage == 3:
        tuned = bool(get_family(cfg.family).zero3_settings) and e.family_settings
        return (
            "expected per GPU: ZeRO-3 measured well below one GPU's best recipe (SDXL full, no offload, 2 H100s: "
            + (
                "0.44x with SDXL's tuned settings, 0.24x without; 0.49-0.62x DDP's step with torch's own linear, "
                "now part of SDXL's settings, 0.68-0.74x on 2 H200s"
                if tuned
                else "0.24x with DeepSpeed's own settings"
            )
            + "): it gathers every weight each step; prefer DDP or FSDP where they fit"
        )
    if e.kind == "deepspeed":
        from ..memory.planner import SPEED

        if e.offload_optimizer_device == "none":
            return "expected per GPU: ~0.6x one GPU's best recipe (measured, SDXL full on ZeRO-2 at 2 H100s: 0.62x)"
        return (
            f"expected per GPU: ZeRO-2 with the optimizer offloaded not measured on several GPUs yet (on one GPU "
            f"its step took {SPEED['zero2_offload']:.2f}x a plain one's)"
        )
    if e.kind == "fsdp":
        if e.offload_params:
            return "expected per GPU: FSDP with its shares in host RAM not measured on GPUs yet"
        keep = not e.reshard_after_forward
        return (
            f"expected per GPU: ~{0.72 if keep else 0.67:.2f}x one GPU's best recipe eager (measured, SDXL full on "
            f"FSDP at 2 H100s{', weights kept from forward to backward' if keep else ''}; ZeRO-3 0.24-0.44x, ZeRO-2 "
            f"0.62x on the same job); with compiled blocks (speed auto on a long run) {0.51 if keep else 0.65:.2f}x "
            f"one GPU's recipe compiled with CUDA graphs on 2 H200s ({1.01 if keep else 1.26:.2f}x its eager step)"
        )
    return None
