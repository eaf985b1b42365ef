"""sd-scripts command lines and TOML configs -> a difftrain config.

``convert(tokens)`` reads what `accelerate launch sdxl_train.py --flag=value ...`
(or `sdxl_train_network.py`, or a `--config_file` TOML) asks for and returns the
equivalent difftrain config as nested dicts, plus every option it could not map
with the reason, so nothing is dropped silently.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..families.registry import sd_scripts_family

# options that need no setting in difftrain, and why
IMPLIED = {
    "xformers": "difftrain uses PyTorch's SDPA attention (flash / memory-efficient kernels): nothing to set",
    "sdpa": "difftrain uses PyTorch's SDPA attention: nothing to set",
    "mem_eff_attn": "difftrain uses PyTorch's SDPA attention: nothing to set",
    "enable_bucket": "difftrain always buckets by aspect ratio",
    "cache_latents": "difftrain precompute caches latents (run `difftrain precompute` first)",
    "cache_latents_to_disk": "difftrain precompute caches latents on disk",
    "cache_text_encoder_outputs_to_disk": "difftrain precompute caches text embeddings on disk",
    "max_data_loader_n_workers": "difftrain reads cached tensors in-process: no loader workers",
    "persistent_data_loader_workers": "difftrain reads cached tensors in-process: no loader workers",
    "save_state": "difftrain checkpoints hold the full training state: set train.checkpoint_every",
    "highvram": "nothing to set: latents are precomputed once",
    "lowram": "difftrain loads single files tensor by tensor straight to the GPU",
}

UNSUPPORTED = {
    "output_name": "difftrain names its outputs model.safetensors / pytorch_lora_weights.safetensors in train.output_dir",
    "fp8_base": "fp8 base weights are not available yet; memory.weights stays bf16",
    "full_fp16": "pure fp16 weights cannot take small updates: use --full_bf16 (bf16 with stochastic rounding)",
    "reg_data_dir": "prior preservation / regularisation images are not available for SDXL yet",
    "prior_loss_weight": "prior preservation is not available for SDXL yet",
    "logging_dir": "difftrain writes metrics.jsonl in train.output_dir",
    "log_with": "difftrain writes metrics.jsonl in train.output_dir",
    "dataset_config": "dataset TOMLs are not read: give the image folder as data.dir",
    "sample_prompts": "validation samples during training are not available yet",
    "sample_every_n_steps": "validation samples during training are not available yet",
    "sample_every_n_epochs": "validation samples during training are not available yet",
    "vae": "a separate VAE file is not supported yet: the checkpoint's VAE is used",
    "clip_skip": "SDXL uses the penultimate layer already; clip_skip has no meaning for SDXL",
}

SCHEDULERS = {"constant", "constant_with_warmup", "linear", "cosine"}
OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit", "adafactor": "adafactor"}


@dataclass
class Conversion:
    config: dict = field(default_factory=dict)
    unmapped: list[tuple[str, str]] = field(default_factory=list)
    script: str | None = None

    def set(self, dotted: str, value: Any) -> None:
        d = self.config
        *head, last = dotted.split(".")
        for k in head:
            d = d.setdefault(k, {})
        d[last] = value


def parse_tokens(tokens: list[str]) -> tuple[str | None, dict[str, Any]]:
    """Split a command line into (training script, {option: value}). Flags without a value are True."""
    if len(tokens) == 1 and " " in tokens[0]:
        tokens = shlex.split(tokens[0])
    script = None
    args: dict[str, Any] = {}
    i = 0
    # skip the launcher (accelerate launch [its options] / python) up to the script
    while i < len(tokens) and not tokens[i].endswith(".py") and not tokens[i].endswith(".toml"):
        i += 1
    if i == len(tokens):
        i = 0
    elif tokens[i].endswith(".py"):
        script = Path(tokens[i]).name
        i += 1
    value: str | bool  # a flag without a value is True
    while i < len(tokens):
        tok = tokens[i]
        if tok.endswith(".toml") and not tok.startswith("--"):
            args.update(read_toml(Path(tok)))
            i += 1
            continue
        if not tok.startswith("--"):
            raise UsageError(
                f"Unexpected argument {tok!r} in the sd-scripts command line.",
                hint="Options look like --name=value or --name value.",
            )
        name, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value = tokens[i + 1]
                i += 1
            else:
                value = True
        args[name.replace("-", "_")] = value
        i += 1
    if "config_file" in args:
        f = args.pop("config_file")
        if not isinstance(f, str) or not f:
            raise UsageError("--config_file needs a TOML file path.", hint="e.g. --config_file config.toml")
        args = {**read_toml(Path(f)), **args}
    return script, args


def read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    if not path.is_file():
        raise UsageError(f"The TOML file {path} does not exist.")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise UsageError(
            f"{path} is not valid TOML: {type(e).__name__}: {e}",
            hint="Give the TOML file sd-scripts reads (--config_file).",
        ) from None
    flat: dict[str, Any] = {}

    def walk(d: dict) -> None:  # sd-scripts' config files group options in arbitrary tables
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            else:
                flat[k] = v

    walk(data)
    return flat


def _num(v: Any) -> float:
    return float(v)


# options that map one to one: sd-scripts name -> (difftrain key, converter)
SIMPLE: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "pretrained_model_name_or_path": ("model.path", str),
    "in_json": ("data.metadata", str),
    "train_data_dir": ("data.dir", str),
    "output_dir": ("train.output_dir", str),
    "train_batch_size": ("train.batch_size", int),
    "learning_rate": ("train.learning_rate", _num),
    "learning_rate_te1": ("full.learning_rate_te1", _num),
    "learning_rate_te2": ("full.learning_rate_te2", _num),
    "max_train_epochs": ("train.epochs", int),
    "max_train_steps": ("train.max_steps", int),
    "min_bucket_reso": ("data.min_side", int),
    "max_bucket_reso": ("data.max_side", int),
    "bucket_reso_steps": ("data.bucket_step", int),
    "seed": ("train.seed", int),
    "gradient_accumulation_steps": ("train.grad_accum", int),
    "noise_offset": ("train.noise_offset", _num),
    "min_snr_gamma": ("train.min_snr_gamma", _num),
    "loss_type": ("train.loss_type", str),
    "huber_schedule": ("train.huber_schedule", str),
    "huber_c": ("train.huber_c", _num),
    "huber_scale": ("train.huber_scale", _num),
    "network_dim": ("lora.rank", int),
    "network_alpha": ("lora.alpha", _num),
    "network_dropout": ("lora.dropout", _num),
    "keep_tokens": ("data.keep_tokens", int),
    "keep_tokens_separator": ("data.keep_tokens_separator", str),
    "caption_separator": ("data.caption_separator", str),
    "caption_dropout_rate": ("data.caption_dropout_rate", _num),
    "caption_tag_dropout_rate": ("data.caption_tag_dropout_rate", _num),
}


def convert(tokens: list[str]) -> Conversion:
    script, args = parse_tokens(tokens)
    c = Conversion(script=script)
    lora = (script is not None and "network" in script) or "network_module" in args or "network_dim" in args
    target = sd_scripts_family()
    assert target.sd_scripts_prefix is not None
    if script and not script.startswith(target.sd_scripts_prefix):
        c.unmapped.append((script, "only SDXL scripts map to difftrain today (sdxl_train.py, sdxl_train_network.py)"))
    c.set("family", target.name)
    c.set("train.method", "lora" if lora else "full")
    if not lora:
        c.set("memory.weights.kind", "fp32")  # sd-scripts keeps fp32 weights under mixed precision
    mixed = str(args.get("mixed_precision", "no"))

    for name, v in args.items():
        try:
            _convert_option(c, name, v, lora)
        except (TypeError, ValueError, OverflowError):
            c.unmapped.append((f"--{name}={v}", "value not understood"))

    if lora and "network_train_unet_only" not in args and "cache_text_encoder_outputs" not in args:
        c.set("train.train_text_encoders", True)  # sd-scripts trains the text encoders' LoRA by default
    if not lora and mixed == "fp16" and "full_bf16" not in args:
        c.set("memory.weights.kind", "fp32")  # fp32 master weights with fp16 autocast and a grad scaler
    return c


def _convert_option(c: Conversion, name: str, v: Any, lora: bool) -> None:
    """Set what option ``--name=v`` maps to in ``c``, or add it to ``c.unmapped`` with the reason. A value it
    cannot read raises TypeError, ValueError or OverflowError."""
    if name in SIMPLE:
        dotted, conv = SIMPLE[name]
        c.set(dotted, conv(v))
    elif _convert_training(c, name, v) or _convert_data_and_saving(c, name, v, lora):
        pass  # converted, or reported with its reason, there
    elif name in IMPLIED:
        c.unmapped.append((f"--{name}", IMPLIED[name] + " (implied)"))
    elif name in UNSUPPORTED:
        c.unmapped.append((f"--{name}" + ("" if v is True else f"={v}"), UNSUPPORTED[name]))
    else:
        c.unmapped.append((f"--{name}" + ("" if v is True else f"={v}"), "no difftrain equivalent known"))


def _convert_training(c: Conversion, name: str, v: Any) -> bool:
    """The options of the training itself: optimizer, precision, schedule, what is trained. False: not one."""
    if name == "use_8bit_adam":
        c.set("memory.optimizer.kind", "adamw8bit")
    elif name == "optimizer_type":
        kind = OPTIMIZERS.get(str(v).lower())
        if kind:
            c.set("memory.optimizer.kind", kind)
        else:
            c.unmapped.append((f"--{name}={v}", "difftrain offers AdamW, AdamW8bit and Adafactor today"))
    elif name == "fused_backward_pass":
        c.set("memory.fused_backward", bool(v))
    elif name == "train_text_encoder":
        c.set("full.train_text_encoder_1", True)
        c.set("full.train_text_encoder_2", True)
    elif name == "gradient_checkpointing":
        c.set("memory.activations.kind", "checkpoint")
    elif name == "mixed_precision":
        if v not in ("no", "fp16", "bf16"):
            raise ValueError
        c.set("train.mixed_precision", v)
    elif name == "full_bf16":
        c.set("memory.weights.kind", "bf16")
        c.set("train.mixed_precision", "bf16")
    elif name == "lr_scheduler":
        if v in SCHEDULERS:
            c.set("train.lr_scheduler", v)
        else:
            c.unmapped.append((f"--{name}={v}", f"difftrain's schedules are {', '.join(sorted(SCHEDULERS))}"))
    elif name == "lr_warmup_steps":
        c.set("train.warmup_steps", int(float(v)))
    elif name == "max_grad_norm":
        c.set("train.max_grad_norm", _num(v) or None)
    elif name == "network_module":
        if v != "networks.lora":
            c.unmapped.append((f"--{name}={v}", "difftrain trains plain LoRA (networks.lora) today"))
    elif name in ("network_train_unet_only", "cache_text_encoder_outputs"):
        c.set("train.train_text_encoders", False)
        if name == "cache_text_encoder_outputs":
            c.unmapped.append(
                (f"--{name}", IMPLIED["cache_text_encoder_outputs_to_disk"] + " (mapped: text encoders frozen)")
            )
    elif name == "v_parameterization":
        c.set("model.prediction_type", "v_prediction")
    else:
        return False
    return True


def _convert_data_and_saving(c: Conversion, name: str, v: Any, lora: bool) -> bool:
    """The options of the data (captions, buckets, latents) and of what is saved when. False: not one."""
    if name == "caption_extension":
        c.set("data.caption_ext", v if str(v).startswith(".") else f".{v}")
    elif name == "resolution":
        w, _, h = str(v).partition(",")
        side = math.isqrt(int(w) * int(h or w))
        c.set("data.resolution", side - side % 64 or 64)
    elif name == "shuffle_caption":
        c.set("data.shuffle_caption", v is True or str(v).lower() in ("true", "1"))
    elif name == "alpha_mask":
        c.set("data.alpha_mask", v is True or str(v).lower() in ("true", "1"))
    elif name == "masked_loss":  # sd-scripts: the dataset config's conditioning_data_dir holds the masks
        c.unmapped.append((f"--{name}", "set data.mask_dir to the masks' folder (sd-scripts' conditioning_data_dir)"))
    elif name == "bucket_no_upscale":
        c.set("data.no_upscale", True)
    elif name == "no_half_vae":
        c.set("precompute.vae_dtype", "fp32")
    elif name == "save_model_as":
        if v in ("safetensors",):
            c.set("save.formats", ["single_file"])
        elif v == "diffusers" or v == "diffusers_safetensors":
            c.set("save.formats", ["diffusers"])
        else:
            c.unmapped.append((f"--{name}={v}", "difftrain writes safetensors only (never pickle .ckpt)"))
    elif name == "save_precision":
        c.set("save.precision", {"float": "fp32"}.get(v, v))
    elif name == "save_every_n_epochs":
        if lora:
            c.unmapped.append(
                (f"--{name}={v}", "for LoRA, checkpoints are counted in steps: set train.checkpoint_every")
            )
        else:
            c.set("save.every_n_epochs", int(v))
    elif name == "save_every_n_steps":
        c.set("train.checkpoint_every" if lora else "save.every_n_steps", int(v))
    else:
        return False
    return True
