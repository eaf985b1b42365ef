"""sd-scripts command lines and TOML configs -> a difftrain config.

``convert(tokens)`` reads what `accelerate launch sdxl_train_network.py --flag=value ...` asks for (SDXL's, SD3's and
FLUX.1's scripts: ``sdxl_train(_network).py``, ``sd3_train(_network).py``, ``flux_train(_network).py``; musubi-tuner's
``wan_train_network.py``; or a `--config_file` TOML) and returns the equivalent difftrain config as nested dicts, plus
every option it could not map with the reason, so nothing is dropped silently.

Every option sd-scripts defines (its argparse ``add_argument`` calls, listed in tests/fixtures/sd_scripts_options.txt
at the commit named there) is in exactly one place here: mapped (SIMPLE or a converter below), IMPLIED (nothing to
set), UNSUPPORTED (the nearest difftrain config, which tests/unit/test_sdscripts_table.py shows does not validate:
once it does, the option must be mapped) or NO_EQUIVALENT (nothing in difftrain's config would hold it, and why).
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..families.registry import REGISTRY, Registered, row, sd_scripts_family
from .dataset_toml import SD_UNMAPPED, read_dataset_toml

# options that need no setting in difftrain, and why
IMPLIED = {
    "xformers": "difftrain uses PyTorch's SDPA attention (flash / memory-efficient kernels): nothing to set",
    "sdpa": "difftrain uses PyTorch's SDPA attention: nothing to set",
    "mem_eff_attn": "difftrain uses PyTorch's SDPA attention: nothing to set",
    "diffusers_xformers": "difftrain uses PyTorch's SDPA attention: nothing to set",
    "enable_bucket": "difftrain always buckets by aspect ratio",
    "cache_latents": "difftrain precompute caches latents (run `difftrain precompute` first)",
    "cache_latents_to_disk": "difftrain precompute caches latents on disk",
    "cache_text_encoder_outputs_to_disk": "difftrain precompute caches text embeddings on disk",
    "use_t5xxl_cache_only": "difftrain precompute caches T5's embeddings; training never loads T5",
    "skip_cache_check": "difftrain's cache is keyed by content: a changed image or caption is encoded again",
    "skip_latents_validity_check": "difftrain's cache is keyed by content: nothing to check at start",
    "max_data_loader_n_workers": "difftrain reads cached tensors in-process: no loader workers",
    "persistent_data_loader_workers": "difftrain reads cached tensors in-process: no loader workers",
    "save_state": "difftrain checkpoints hold the full training state: set train.checkpoint_every",
    "save_state_on_train_end": "difftrain always writes a final checkpoint",
    "highvram": "nothing to set: latents are precomputed once",
    "lowram": "difftrain loads single files tensor by tensor straight to the GPU",
    "disable_mmap_load_safetensors": "difftrain reads safetensors tensor by tensor",
    "mem_eff_save": "difftrain writes safetensors tensor by tensor, atomically",
    "use_safetensors": "difftrain writes safetensors only",
    "zero3_init_flag": "memory.engine deepspeed stage 3 builds the model sharded",
    "zero3_save_16bit_model": "difftrain gathers a ZeRO-3 model's weights when it exports them",
    "logging_dir": "difftrain writes metrics.jsonl and TensorBoard files in train.output_dir",
    "dynamo_backend": "speed.compile uses torch.compile's inductor backend",
}

#: options difftrain does not take, each with the reason and the nearest difftrain config where one is plausible.
#: tests/unit/test_sdscripts_table.py validates each of these configs and fails when one validates: then difftrain
#: has grown the option, and the option belongs in the mapped ones.
UNSUPPORTED: dict[str, tuple[str, dict[str, Any]]] = {
    "full_fp16": (
        "pure fp16 weights cannot take small updates: use --full_bf16 (bf16 with stochastic rounding)",
        {"memory.weights.kind": "fp16", "train.method": "full"},
    ),
    "sample_every_n_epochs": (
        "validation samples are counted in steps: set validation.every_n_steps",
        {"validation.every_n_epochs": 1},
    ),
    "sample_sampler": (
        "validation samples use the model's own scheduler (the pipeline's default)",
        {"validation.sampler": "euler_a"},
    ),
    "sample_at_first": (
        "validation samples are made every validation.every_n_steps and at the end",
        {"validation.at_first": True},
    ),
    "validate_every_n_epochs": (
        "the validation loss is counted in steps: set validation.every_n_steps",
        {"validation.every_n_epochs": 1},
    ),
    "clip_skip": (
        "not available: each family uses the layer its pipeline uses (SDXL: the penultimate)",
        {"text_encoders.clip_skip": 2},
    ),
    "max_token_length": (
        "CLIP captions are 77 tokens (longer ones are truncated)",
        {"text_encoders.clip.max_length": 225},
    ),
    "weighted_captions": ("not available: (word:1.2) weights are read as plain text", {"data.weighted_captions": True}),
    "lr_scheduler_num_cycles": ("difftrain's cosine is one cycle", {"train.lr_scheduler_num_cycles": 2}),
    "lr_scheduler_power": ("difftrain has no polynomial schedule", {"train.lr_scheduler": "polynomial"}),
    "lr_scheduler_type": ("difftrain's schedules are built in (train.lr_scheduler)", {"train.lr_scheduler_type": "x"}),
    "lr_scheduler_args": ("difftrain's schedules take no arguments", {"train.lr_scheduler_args": ["x"]}),
    "lr_scheduler_min_lr_ratio": ("difftrain's schedules decay to 0", {"train.min_lr_ratio": 0.1}),
    "lr_scheduler_timescale": ("difftrain has no inverse-sqrt schedule", {"train.lr_scheduler": "inverse_sqrt"}),
    "lr_decay_steps": ("difftrain has no warmup-stable-decay schedule", {"train.lr_scheduler": "warmup_stable_decay"}),
    "use_lion_optimizer": (
        "difftrain's optimizers are AdamW (8-, 4-bit, offloaded) and Adafactor",
        {"memory.optimizer.kind": "lion"},
    ),
    "text_encoder_lr": (
        "a LoRA trains at one learning rate (train.learning_rate)",
        {"train.text_encoder_learning_rate": 1e-5},
    ),
    "network_train_text_encoder_only": ("a LoRA run trains the denoiser's adapter", {"train.train_unet": False}),
    "scale_weight_norms": ("not available: no max-norm regularisation of the LoRA", {"lora.max_norm": 1.0}),
    "v_pred_like_loss": ("not available", {"train.v_pred_like_loss": 0.1}),
    "scale_v_pred_loss_like_noise_pred": ("not available", {"train.scale_v_pred_loss_like_noise_pred": True}),
    "zero_terminal_snr": ("not available: SDXL trains on its own noise schedule", {"train.zero_terminal_snr": True}),
    "debiased_estimation_loss": (
        "not available: train.min_snr_gamma weights the loss by SNR",
        {"train.debiased_estimation_loss": True},
    ),
    "ip_noise_gamma": ("not available: no input perturbation noise", {"train.ip_noise_gamma": 0.1}),
    "ip_noise_gamma_random_strength": ("not available: no input perturbation noise", {"train.ip_noise_gamma": 0.1}),
    "multires_noise_iterations": (
        "not available: train.noise_offset is the noise option",
        {"train.multires_noise_iterations": 6},
    ),
    "multires_noise_discount": (
        "not available: train.noise_offset is the noise option",
        {"train.multires_noise_discount": 0.3},
    ),
    "adaptive_noise_scale": ("not available: train.noise_offset is fixed", {"train.adaptive_noise_scale": 0.01}),
    "noise_offset_random_strength": (
        "not available: train.noise_offset is fixed",
        {"train.noise_offset_random_strength": True},
    ),
    "min_timestep": (
        "DDPM families train on every timestep (flow families: flow.min_timestep)",
        {"train.min_timestep": 100},
    ),
    "max_timestep": (
        "DDPM families train on every timestep (flow families: flow.max_timestep)",
        {"train.max_timestep": 900},
    ),
    "apply_t5_attn_mask": (
        "not available: T5's padding is attended as the pipelines do",
        {"text_encoders.t5.attention_mask": True},
    ),
    "apply_lg_attn_mask": (
        "not available: CLIP's padding is attended as the pipelines do",
        {"text_encoders.clip_attention_mask": True},
    ),
    "clip_l_dropout_rate": (
        "not available per encoder: data.caption_dropout_rate drops the whole caption",
        {"text_encoders.clip_l_dropout_rate": 0.1},
    ),
    "clip_g_dropout_rate": (
        "not available per encoder: data.caption_dropout_rate drops the whole caption",
        {"text_encoders.clip_g_dropout_rate": 0.1},
    ),
    "t5_dropout_rate": (
        "not available per encoder: data.caption_dropout_rate drops the whole caption",
        {"text_encoders.t5.dropout_rate": 0.1},
    ),
    "train_t5xxl": ("T5 is never trained (its embeddings are cached)", {"full.train_text_encoder_3": True}),
    "learning_rate_te3": ("T5 is never trained (its embeddings are cached)", {"full.learning_rate_te3": 1e-5}),
    "model_prediction_type": (
        "difftrain trains the velocity as predicted (sd-scripts' raw); additive / sigma_scaled are not available",
        {"flow.model_prediction_type": "sigma_scaled"},
    ),
    "sigmoid_scale": (
        "read with --timestep_sampling sigmoid / shift / flux_shift only (flow.logit_std)",
        {"flow.sigmoid_scale": 1.0},
    ),
    "model_type": ("FLUX.1 only: Chroma is not a difftrain family", {"family": "chroma"}),
    "weighting_scheme": (
        "only the flow families' scripts read it (flow.timestep_sampling / loss_weighting)",
        {"train.weighting_scheme": "x"},
    ),
    "mode_scale": ("only the flow families' scripts read it (flow.mode_scale)", {"train.mode_scale": 1.29}),
    "logit_mean": ("only the flow families' scripts read it (flow.logit_mean)", {"train.logit_mean": 0.0}),
    "logit_std": ("only the flow families' scripts read it (flow.logit_std)", {"train.logit_std": 1.0}),
    "fp16_master_weights_and_gradients": (
        "not available: trained weights are fp32 or bf16",
        {"memory.weights.kind": "fp16", "train.method": "full"},
    ),
    "validation_split": (
        "difftrain holds out validation.loss_items items, a count rather than a share",
        {"validation.split": 0.1},
    ),
    "max_validation_steps": ("every held-out item is evaluated (validation.loss_items)", {"validation.max_steps": 10}),
    "dataset_repeats": (
        "repeats are per folder: data.subsets[].num_repeats, or kohya's <repeats>_<name> folders",
        {"data.num_repeats": 2},
    ),
    "block_lr": ("one learning rate for the denoiser", {"full.block_lr": [1e-5]}),
    "num_last_block_to_freeze": ("not available: every block of the denoiser is trained", {"full.frozen_blocks": 1}),
    "t5xxl_device": ("precompute loads T5 on its device (precompute.device)", {"text_encoders.t5.device": "cpu"}),
}

#: dataset-TOML keys that sd-scripts also takes on the command line and that are placed elsewhere here
_ELSEWHERE = {"enable_bucket", "cache_info", "validation_seed", "validation_split"}

#: options with no place in difftrain's config at all, and why
NO_EQUIVALENT: dict[str, str] = {
    "output_name": "difftrain names its outputs model.safetensors / pytorch_lora_weights.safetensors in train.output_dir",
    "log_prefix": "difftrain's run folder is its name",
    "log_tracker_name": "report.wandb_project names the Weights & Biases project",
    "log_tracker_config": "difftrain's reports take no tracker config",
    "log_config": "the resolved config is written to the run folder always (config.yaml)",
    "wandb_api_key": "log in with `wandb login`; difftrain never takes keys on its command line",
    "wandb_run_name": "the run folder names the run",
    "training_comment": "not recorded (save.trigger_phrase goes into the LoRA's metadata)",
    "no_metadata": "the LoRA's header metadata is always written",
    "output_config": "difftrain convert-args prints the config; `difftrain train` writes config.yaml",
    "debug_dataset": "`difftrain precompute --plan-only` shows the buckets and captions",
    "dataset_class": "difftrain reads folders, metadata JSON and dataset TOMLs only",
    "huggingface_repo_id": "difftrain does not upload: upload train.output_dir yourself (huggingface-cli upload)",
    "huggingface_repo_type": "difftrain does not upload",
    "huggingface_path_in_repo": "difftrain does not upload",
    "huggingface_token": "difftrain does not upload",
    "huggingface_repo_visibility": "difftrain does not upload",
    "save_state_to_huggingface": "difftrain does not upload",
    "resume_from_huggingface": "resume from a local checkpoint: difftrain train --resume FOLDER",
    "async_upload": "difftrain does not upload",
    "resume": "a command-line option of difftrain train: --resume FOLDER (or latest)",
    "initial_epoch": "difftrain train --resume continues where the checkpoint stopped",
    "initial_step": "difftrain train --resume continues where the checkpoint stopped",
    "skip_until_initial_step": "difftrain train --resume continues where the checkpoint stopped",
    "save_n_epoch_ratio": "checkpoints are counted in steps (train.checkpoint_every)",
    "save_last_n_epochs": "train.keep_checkpoints keeps the newest N checkpoints (a count)",
    "save_last_n_epochs_state": "train.keep_checkpoints keeps the newest N checkpoints (a count)",
    "save_last_n_steps": "train.keep_checkpoints keeps the newest N checkpoints (a count)",
    "save_last_n_steps_state": "train.keep_checkpoints keeps the newest N checkpoints (a count)",
    "base_weights": "merge the LoRA into the base model first: difftrain lora merge",
    "base_weights_multiplier": "merge the LoRA into the base model first: difftrain lora merge",
    "dim_from_weights": "set lora.rank to the file's rank with lora.init_weights (it is checked against the file)",
    "fused_optimizer_groups": "memory.fused_backward steps each parameter as its gradient arrives",
    "ddp_timeout": "the process group's timeout is torch's default",
    "offload_optimizer_nvme_path": "DeepSpeed offloads to host RAM only (memory.engine offload_optimizer_device: cpu)",
    "offload_param_nvme_path": "DeepSpeed offloads to host RAM only (memory.engine offload_param_device: cpu)",
    "v2": "SD 2.x is not a difftrain family",
    "controlnet_model_name_or_path": "ControlNets are not trained by difftrain",
    "support_controlnet": "ControlNets are not trained by difftrain",
    "support_dreambooth": "a dataset-class switch of sd-scripts: difftrain reads kohya layouts and dataset TOMLs",
    "support_finetuning": "a dataset-class switch of sd-scripts: difftrain reads metadata JSON (data.metadata)",
    "support_dropout": "a dataset-class switch of sd-scripts",
    "tokenizer_cache_dir": "single files find their tokenizers offline (model.tokenizer_path for another folder)",
    "save_clip": "difftrain exports what it trains (text encoders are cached, not trained, in LoRA runs)",
    "save_t5xxl": "difftrain exports what it trains (T5 is never trained)",
    "enable_scaled_pos_embed": "SD3.5's scaled position embedding for multi-resolution: not available",
    "pos_emb_random_crop_rate": "SD3.5's position-embedding crop augmentation: not available",
    "split_mode": "deprecated in sd-scripts (FLUX.1's split blocks): use --blocks_to_swap (memory.offload block_swap)",
    "double_blocks_to_swap": "deprecated in sd-scripts: use --blocks_to_swap (memory.offload block_swap)",
    "single_blocks_to_swap": "deprecated in sd-scripts: use --blocks_to_swap (memory.offload block_swap)",
    "network_multiplier": "every dataset trains the adapter at full strength",
    "timestep_sampling": "an option of the flow families' scripts (flow.timestep_sampling): not read for DDPM",
    "discrete_flow_shift": "an option of the flow families' scripts (flow.shift): not read for DDPM",
    "training_shift": "an option of SD3's scripts (flow.shift): not read for DDPM",
    "guidance_scale": "an option of FLUX.1's scripts (flow.guidance_scale): not read for DDPM",
    # sd-scripts' dataset options also taken on the command line: the same reasons as in a dataset TOML
    **{k: why for k, (_default, why) in SD_UNMAPPED.items() if k not in _ELSEWHERE},
    "cache_info": "implied: difftrain's precompute keeps image sizes and captions in its cache",
}

#: sd-scripts' --lr_scheduler names difftrain has (train.lr_scheduler)
SCHEDULERS = {"constant", "constant_with_warmup", "linear", "cosine"}
#: sd-scripts' --optimizer_type (lowercase) -> memory.optimizer
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"kind": "adamw"},
    "adamw8bit": {"kind": "adamw8bit"},
    "pagedadamw8bit": {"kind": "adamw8bit", "paged": True},
    "bitsandbytes.optim.adamw8bit": {"kind": "adamw8bit"},
    "bitsandbytes.optim.pagedadamw8bit": {"kind": "adamw8bit", "paged": True},
    "torchao.optim.adamw8bit": {"kind": "adamw8bit", "backend": "torchao"},
    "torchao.optim.adamw4bit": {"kind": "adamw4bit"},
    "adafactor": {"kind": "adafactor"},
    "transformers.optimization.adafactor": {"kind": "adafactor"},
}
#: what each --optimizer_type that difftrain lacks would be: checked not to validate (the test of the table)
OPTIMIZERS_MISSING: dict[str, str] = {
    "prodigy": "prodigy",
    "prodigyplusschedulefree": "prodigy",
    "lion": "lion",
    "lion8bit": "lion8bit",
    "pagedlion8bit": "lion8bit",
    "sgdnesterov": "sgd",
    "sgdnesterov8bit": "sgd8bit",
    "dadaptation": "dadaptation",
    "dadaptadam": "dadaptation",
    "dadaptadagrad": "dadaptation",
    "dadaptadan": "dadaptation",
    "dadaptadanip": "dadaptation",
    "dadaptlion": "dadaptation",
    "dadaptsgd": "dadaptation",
    "adamwschedulefree": "schedulefree",
    "radamschedulefree": "schedulefree",
    "sgdschedulefree": "schedulefree",
    "ademamix8bit": "ademamix8bit",
    "pagedademamix8bit": "ademamix8bit",
    "came": "came",
}
#: --lr_scheduler values difftrain lacks: checked not to validate
SCHEDULERS_MISSING = (
    "cosine_with_restarts",
    "polynomial",
    "adafactor",
    "cosine_with_min_lr",
    "inverse_sqrt",
    "warmup_stable_decay",
    "piecewise_constant",
)
#: LyCORIS algorithms difftrain lacks (--network_args algo=...) and the lora.type each would be
LYCORIS_MISSING = {
    "ia3": "ia3",
    "glora": "glora",
    "dylora": "dylora",
    "full": "full",
    "diag-oft": "oft",
    "boft": "boft",
}
#: LyCORIS / sd-scripts --network_args keys lora.* lacks, each with the nearest lora config (checked not to validate)
NETWORK_ARGS_MISSING: dict[str, dict[str, Any]] = {
    "conv_dim": {"lora.conv_rank": 4},
    "conv_alpha": {"lora.conv_alpha": 1.0},
    "preset": {"lora.preset": "attn-mlp"},
    "use_scalar": {"lora.type": "lokr", "lora.use_scalar": True},
    "rank_dropout_scale": {"lora.type": "lokr", "lora.rank_dropout_scale": True},
    "train_norm": {"lora.train_norm": True},
    "bypass_mode": {"lora.bypass_mode": True},
    "down_lr_weight": {"lora.block_lr": [1.0]},
    "mid_lr_weight": {"lora.block_lr": [1.0]},
    "up_lr_weight": {"lora.block_lr": [1.0]},
    "block_dims": {"lora.block_ranks": [4]},
    "block_alphas": {"lora.block_alphas": [4.0]},
    "conv_block_dims": {"lora.conv_block_ranks": [4]},
    "conv_block_alphas": {"lora.conv_block_alphas": [4.0]},
    "train_blocks": {"lora.train_blocks": "single"},
    "train_double_block_indices": {"lora.train_blocks": "0-5"},
    "train_single_block_indices": {"lora.train_blocks": "0-5"},
    "split_qkv": {"lora.split_qkv": True},
    "train_t5xxl": {"lora.train_t5xxl": True},
    "loraplus_lr_ratio": {"lora.loraplus_lr_ratio": 16.0},
    "loraplus_unet_lr_ratio": {"lora.loraplus_lr_ratio": 16.0},
    "loraplus_text_encoder_lr_ratio": {"lora.loraplus_lr_ratio": 16.0},
}


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

    def get(self, dotted: str) -> Any:
        d: Any = self.config
        for k in dotted.split("."):
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d


def parse_tokens(tokens: list[str]) -> tuple[str | None, dict[str, Any]]:
    """Split a command line into (training script, {option: value}). Flags without a value are True; an option
    followed by several values (sd-scripts' nargs='*' options: --network_args, --optimizer_args ...) is a list."""
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
    value: str | bool | list[str]  # a flag without a value is True
    while i < len(tokens):
        tok = tokens[i]
        if tok.endswith(".toml") and not tok.startswith("--"):
            args.update(read_toml(Path(tok)))
            i += 1
            continue
        if not tok.startswith("--"):
            raise UsageError(
                f"Unexpected argument {tok!r} in the sd-scripts command line.",
                hint="Options look like --name=value or --name value (several values after one option are read as "
                "its list, as sd-scripts reads --network_args a=1 b=2).",
            )
        name, eq, value = tok[2:].partition("=")
        if not eq:
            values = []
            while i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                values.append(tokens[i + 1])
                i += 1
            value = True if not values else values[0] if len(values) == 1 else values
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
    if isinstance(v, list):
        raise TypeError("one value expected")
    return float(v)


def _int(v: Any) -> int:
    if isinstance(v, list | bool):
        raise TypeError("one value expected")
    return int(v)


def _str(v: Any) -> str:
    if isinstance(v, list | bool):
        raise TypeError("one value expected")
    return str(v)


def _bool(v: Any) -> bool:
    return v is True or str(v).lower() in ("true", "1", "yes")


# options that map one to one: sd-scripts name -> (difftrain key, converter)
SIMPLE: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "pretrained_model_name_or_path": ("model.path", _str),
    "in_json": ("data.metadata", _str),
    "train_data_dir": ("data.dir", _str),
    "reg_data_dir": ("data.reg_dir", _str),
    "prior_loss_weight": ("dreambooth.prior_loss_weight", _num),
    "output_dir": ("train.output_dir", _str),
    "train_batch_size": ("train.batch_size", _int),
    "learning_rate": ("train.learning_rate", _num),
    "learning_rate_te1": ("full.learning_rate_te1", _num),
    "learning_rate_te2": ("full.learning_rate_te2", _num),
    "max_train_epochs": ("train.epochs", _int),
    "max_train_steps": ("train.max_steps", _int),
    "min_bucket_reso": ("data.min_side", _int),
    "max_bucket_reso": ("data.max_side", _int),
    "bucket_reso_steps": ("data.bucket_step", _int),
    "seed": ("train.seed", _int),
    "gradient_accumulation_steps": ("train.grad_accum", _int),
    "noise_offset": ("train.noise_offset", _num),
    "min_snr_gamma": ("train.min_snr_gamma", _num),
    "loss_type": ("train.loss_type", _str),
    "huber_schedule": ("train.huber_schedule", _str),
    "huber_c": ("train.huber_c", _num),
    "huber_scale": ("train.huber_scale", _num),
    "network_dim": ("lora.rank", _int),
    "network_alpha": ("lora.alpha", _num),
    "network_dropout": ("lora.dropout", _num),
    "network_weights": ("lora.init_weights", _str),
    "keep_tokens": ("data.keep_tokens", _int),
    "keep_tokens_separator": ("data.keep_tokens_separator", _str),
    "caption_separator": ("data.caption_separator", _str),
    "caption_dropout_rate": ("data.caption_dropout_rate", _num),
    "caption_tag_dropout_rate": ("data.caption_tag_dropout_rate", _num),
    "caption_prefix": ("data.caption_prefix", _str),
    "caption_suffix": ("data.caption_suffix", _str),
    "vae_batch_size": ("precompute.batch_size", _int),
    "text_encoder_batch_size": ("precompute.batch_size", _int),
    "validation_seed": ("validation.seed", _int),
    "validate_every_n_steps": ("validation.every_n_steps", _int),
    "sample_every_n_steps": ("validation.every_n_steps", _int),
    "random_crop": ("data.random_crop", _bool),
    "bucket_no_upscale": ("data.no_upscale", _bool),
    "alpha_mask": ("data.alpha_mask", _bool),
    "flip_aug": ("data.flip_aug", _bool),
    "shuffle_caption": ("data.shuffle_caption", _bool),
    "fused_backward_pass": ("memory.fused_backward", _bool),
    "blockwise_fused_optimizers": ("memory.fused_backward", _bool),
    "torch_compile": ("speed.compile", _bool),
    "ddp_gradient_as_bucket_view": ("memory.engine.gradient_as_bucket_view", _bool),
    "ddp_static_graph": ("memory.engine.static_graph", _bool),
}

#: options only the flow families' scripts (FLUX.1, SD3, musubi-tuner's Wan) define; read in _convert_flow
FLOW_OPTIONS = {
    "timestep_sampling",
    "discrete_flow_shift",
    "training_shift",
    "sigmoid_scale",
    "weighting_scheme",
    "logit_mean",
    "logit_std",
    "mode_scale",
    "guidance_scale",
    "model_prediction_type",
    "min_timestep",
    "max_timestep",
}


def convert(tokens: list[str]) -> Conversion:
    script, args = parse_tokens(tokens)
    c = Conversion(script=script)
    target = sd_scripts_family(script)
    if target is None:
        target = sd_scripts_family()
        assert target is not None
        known = ", ".join(f"{r.sd_scripts_prefix}train(_network).py" for r in REGISTRY if r.sd_scripts_prefix)
        c.unmapped.append((str(script), f"difftrain maps these scripts: {known}; read as {target.name}'s"))
    lora = (script is not None and "network" in script) or "network_module" in args or "network_dim" in args
    flow = target.sd_scripts_shift is not None
    family = target
    if "task" in args:  # musubi-tuner: --task t2v-14B / i2v-14B / t2v-A14B / ti2v-5B ...
        family = _musubi_task(c, target, args.pop("task"))
    c.set("family", family.name)
    c.set("train.method", "lora" if lora else "full")
    if not lora:
        c.set("memory.weights.kind", "fp32")  # sd-scripts keeps fp32 weights under mixed precision
    mixed = str(args.get("mixed_precision", "no"))
    if flow:
        try:
            _convert_flow(c, target, args)
        except (TypeError, ValueError, OverflowError):
            given = [_shown(k, v) for k, v in args.items() if k in FLOW_OPTIONS]
            c.unmapped.append((" ".join(given), "value not understood (the flow section keeps what was read)"))

    for name, v in args.items():
        if flow and name in FLOW_OPTIONS:
            continue
        try:
            _convert_option(c, name, v, lora, family)
        except (TypeError, ValueError, OverflowError):
            c.unmapped.append((_shown(name, v), "value not understood"))

    _settle(c, args, lora)
    if "optimizer_args" in args:
        v = args["optimizer_args"]
        _optimizer_args(c, v if isinstance(v, list) else [v])
    if lora and "network_train_unet_only" not in args and "cache_text_encoder_outputs" not in args and not flow:
        c.set("train.train_text_encoders", True)  # sd-scripts trains the text encoders' LoRA by default (SDXL)
    if not lora and mixed == "fp16" and "full_bf16" not in args:
        c.set("memory.weights.kind", "fp32")  # fp32 master weights with fp16 autocast and a grad scaler
    return c


def _settle(c: Conversion, args: dict[str, Any], lora: bool) -> None:
    """What sd-scripts does with options that only mean something together."""
    if c.get("train.warmup_steps") and c.get("train.lr_scheduler") in (None, "constant"):
        c.config["train"].pop("warmup_steps")  # sd-scripts' default constant schedule ignores warmup, as difftrain's
        c.unmapped.append((_shown("lr_warmup_steps", args["lr_warmup_steps"]), "the constant schedule has no warmup"))
    if c.get("memory.fused_backward"):
        if lora:
            c.config["memory"].pop("fused_backward")
            c.unmapped.append(("--fused_backward_pass", "for full fine-tunes (a LoRA's gradients are small)"))
        else:
            if "max_grad_norm" not in args or c.get("train.max_grad_norm"):  # sd-scripts' default: 1.0
                c.unmapped.append(
                    ("--max_grad_norm", "not under fused backward: sd-scripts clips each tensor alone, difftrain not")
                )
            c.set("train.max_grad_norm", None)
    engine = c.get("memory.engine")
    if isinstance(engine, dict) and "kind" not in engine:
        engine["kind"] = "ddp"


def _shown(name: str, v: Any) -> str:
    if v is True:
        return f"--{name}"
    if isinstance(v, list):
        return f"--{name} " + " ".join(str(x) for x in v)
    return f"--{name}={v}"


def _musubi_task(c: Conversion, target: Registered, task: Any) -> Registered:
    """musubi-tuner's --task: image-to-video tasks are the family's -i2v sibling; the rest is the model's config."""
    t = str(task).lower()
    if "i2v" in t and "ti2v" not in t:
        try:
            return row(f"{target.name}-i2v")
        except UsageError:
            pass
    c.unmapped.append(
        (f"--task={task}", "the model's size and version are read from its files (model.config to name them)")
    )
    return target


def _convert_option(c: Conversion, name: str, v: Any, lora: bool, family: Registered) -> None:
    """Set what option ``--name=v`` maps to in ``c``, or add it to ``c.unmapped`` with the reason. A value it
    cannot read raises TypeError, ValueError or OverflowError."""
    if name in SIMPLE:
        dotted, conv = SIMPLE[name]
        c.set(dotted, conv(v))
    elif (
        _convert_training(c, name, v, lora)
        or _convert_data_and_saving(c, name, v, lora, family)
        or _convert_model(c, name, v, lora, family)
        or _convert_network(c, name, v)
    ):
        pass  # converted, or reported with its reason, there
    elif name in IMPLIED:
        c.unmapped.append((_shown(name, v), IMPLIED[name] + " (implied)"))
    elif name in UNSUPPORTED:
        c.unmapped.append((_shown(name, v), UNSUPPORTED[name][0]))
    elif name in NO_EQUIVALENT:
        c.unmapped.append((_shown(name, v), NO_EQUIVALENT[name]))
    else:
        c.unmapped.append((_shown(name, v), UNKNOWN))


#: the reason given for an option this table does not know
UNKNOWN = "no difftrain equivalent known"


def _convert_training(c: Conversion, name: str, v: Any, lora: bool) -> bool:
    """The options of the training itself: optimizer, precision, schedule, engine. False: not one."""
    if name == "use_8bit_adam":
        c.set("memory.optimizer.kind", "adamw8bit")
    elif name == "optimizer_type":
        opt = OPTIMIZERS.get(_str(v).lower())
        if opt:
            for k, x in opt.items():
                c.set(f"memory.optimizer.{k}", x)
        else:
            c.unmapped.append(
                (_shown(name, v), "difftrain offers AdamW, AdamW8bit (paged too), 4-bit AdamW and Adafactor")
            )
    elif name == "optimizer_args":
        pass  # read after every other option (convert): its keys depend on the optimizer
    elif name == "train_text_encoder" and lora:
        c.set("train.train_text_encoders", True)
    elif name == "train_text_encoder":
        c.set("full.train_text_encoder_1", True)
        c.set("full.train_text_encoder_2", True)
    elif name == "gradient_checkpointing":
        c.set("memory.activations.kind", "checkpoint")
    elif name == "cpu_offload_checkpointing":
        c.set("memory.activations.kind", "checkpoint")
        c.set("memory.activations.offload", True)
    elif name == "mixed_precision":
        if v not in ("no", "fp16", "bf16"):
            raise ValueError
        c.set("train.mixed_precision", v)
    elif name == "full_bf16":
        c.set("memory.weights.kind", "bf16")
        c.set("train.mixed_precision", "bf16")
    elif name in ("fp8_base", "fp8_base_unet"):
        if lora:
            c.set("memory.weights.kind", "fp8")  # the frozen base weights in float8, upcast per layer
        else:
            c.unmapped.append((_shown(name, v), "fp8 storage is for a LoRA's frozen base weights (memory.weights fp8)"))
    elif name == "blocks_to_swap":
        c.set("memory.offload", {"kind": "block_swap", "blocks_to_swap": _int(v)})
    elif name == "lr_scheduler":
        if v in SCHEDULERS:
            c.set("train.lr_scheduler", v)
        else:
            c.unmapped.append((_shown(name, v), f"difftrain's schedules are {', '.join(sorted(SCHEDULERS))}"))
    elif name == "lr_warmup_steps":
        c.set("train.warmup_steps", int(float(v)))
    elif name == "max_grad_norm":
        c.set("train.max_grad_norm", _num(v) or None)
    elif name == "unet_lr":
        if lora:
            c.set("train.learning_rate", _num(v))
        else:
            c.unmapped.append((_shown(name, v), "a full fine-tune's denoiser trains at train.learning_rate"))
    elif name in ("deepspeed", "zero_stage", "offload_optimizer_device", "offload_param_device"):
        _deepspeed(c, name, v)
    elif name in ("network_train_unet_only", "cache_text_encoder_outputs"):
        c.set("train.train_text_encoders", False)
        if name == "cache_text_encoder_outputs":
            c.unmapped.append(
                (_shown(name, v), IMPLIED["cache_text_encoder_outputs_to_disk"] + " (mapped: text encoders frozen)")
            )
    elif name == "v_parameterization":
        c.set("model.prediction_type", "v_prediction")
    else:
        return False
    return True


def _optimizer_args(c: Conversion, items: list[Any]) -> None:
    """--optimizer_args weight_decay=0.01 betas=0.9,0.99 eps=1e-8 for the optimizer chosen (Adafactor's
    scale_parameter / relative_step / warmup_init False are difftrain's Adafactor already)."""
    kind = c.get("memory.optimizer.kind") or "adamw"
    adam = kind != "adafactor"
    for item in items:
        k, eq, val = str(item).partition("=")
        k = k.strip()
        try:
            if not eq:
                raise ValueError
            if k == "weight_decay":
                c.set("memory.optimizer.weight_decay", float(val))
            elif k == "eps" and adam:
                c.set("memory.optimizer.eps", float(val))
            elif k == "betas" and adam:
                c.set("memory.optimizer.betas", [float(b) for b in val.strip("()[] ").split(",")])
            elif k in ("scale_parameter", "relative_step", "warmup_init") and not adam and val.lower() == "false":
                pass  # difftrain's Adafactor: the learning rate as given, no warmup (sd-scripts' recommended use)
            else:
                c.unmapped.append((f"--optimizer_args {item}", f"not an option of difftrain's {kind}"))
                continue
            c.set("memory.optimizer.kind", kind)
        except ValueError:
            c.unmapped.append((f"--optimizer_args {item}", "value not understood"))


def _deepspeed(c: Conversion, name: str, v: Any) -> None:
    if name == "deepspeed":
        c.set("memory.engine.kind", "deepspeed")
        return
    if name == "zero_stage":
        if _int(v) not in (2, 3):
            c.unmapped.append((_shown(name, v), "difftrain runs DeepSpeed's ZeRO stages 2 and 3"))
            return
        c.set("memory.engine.stage", _int(v))
    else:
        if v not in ("none", "cpu"):
            c.unmapped.append((_shown(name, v), "DeepSpeed offloads to host RAM only (cpu) or not at all (none)"))
            return
        c.set(f"memory.engine.{name}", v)
    c.set("memory.engine.kind", "deepspeed")


def _convert_data_and_saving(c: Conversion, name: str, v: Any, lora: bool, family: Registered) -> bool:
    """The options of the data (captions, buckets, latents, samples) and of what is saved when. False: not one."""
    if name in ("caption_extension", "caption_extention"):  # the second: sd-scripts' old spelling, still read
        c.set("data.caption_ext", v if str(v).startswith(".") else f".{v}")
    elif name == "resolution":
        w, _, h = _str(v).partition(",")
        side = math.isqrt(int(w) * int(h or w))
        c.set("data.resolution", side - side % 64 or 64)
    elif name == "masked_loss":  # sd-scripts: the dataset config's conditioning_data_dir holds the masks
        c.unmapped.append((f"--{name}", "set data.mask_dir to the masks' folder (sd-scripts' conditioning_data_dir)"))
    elif name == "dataset_config":
        reading = read_dataset_toml(_str(v))
        _merge(c.config, reading.config)
        c.unmapped.extend((f"--dataset_config {v}: {key}", why) for key, why in reading.unmapped)
    elif name == "sample_prompts":
        _sample_prompts(c, Path(_str(v)), family.sd_scripts_guidance)
    elif name == "log_with":
        sinks = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "all": ["tensorboard", "wandb"]}.get(_str(v))
        if sinks is None:
            raise ValueError
        c.set("report.to", sinks)
    elif name == "no_half_vae":
        c.set("precompute.vae_dtype", "fp32")
    elif name == "t5xxl_dtype":
        dtype = {"float": "fp32", "fp32": "fp32", "float32": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(_str(v))
        if dtype is None:
            raise ValueError
        c.set("text_encoders.t5.precision", dtype)
    elif name == "t5xxl_max_token_length":
        c.set("text_encoders.t5.max_length", _int(v))
    elif name == "save_model_as":
        if v in ("safetensors",):
            c.set("save.formats", ["single_file"])
        elif v == "diffusers" or v == "diffusers_safetensors":
            c.set("save.formats", ["diffusers"])
        else:
            c.unmapped.append((_shown(name, v), "difftrain writes safetensors only (never pickle .ckpt)"))
    elif name == "save_precision":
        c.set("save.precision", {"float": "fp32"}.get(v, v))
    elif name == "save_every_n_epochs":
        if lora:
            c.unmapped.append(
                (_shown(name, v), "for LoRA, checkpoints are counted in steps: set train.checkpoint_every")
            )
        else:
            c.set("save.every_n_epochs", _int(v))
    elif name == "save_every_n_steps":
        c.set("train.checkpoint_every" if lora else "save.every_n_steps", _int(v))
    else:
        return False
    return True


def _merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _convert_model(c: Conversion, name: str, v: Any, lora: bool, family: Registered) -> bool:
    """A part's own file: --vae (SDXL's scripts), --ae / --clip_l / --t5xxl (FLUX.1's, SD3's), musubi-tuner's --dit,
    --vae and --t5. The family's registry row says which it reads (model.ae, model.clip_l, model.t5xxl)."""
    part = {"vae": "ae", "ae": "ae", "t5": "t5xxl"}.get(name, name)
    if name not in ("vae", "ae", "clip_l", "clip_g", "t5xxl", "t5", "clip", "dit"):
        return False
    if name == "dit":
        c.set("model.path", _str(v))
    elif part in family.part_files:
        c.set(f"model.{part}", _str(v))
    else:
        c.unmapped.append(
            (
                _shown(name, v),
                f"difftrain's {family.name} does not read this part from a file of its own: it comes from "
                "model.path (a single file holding every part, or a diffusers folder)",
            )
        )
    return True


def _convert_network(c: Conversion, name: str, v: Any) -> bool:
    """--network_module networks.lora | lycoris.kohya | networks.lora_flux ..., and --network_args."""
    if name == "network_module":
        mod = _str(v)
        if not (mod.startswith("networks.lora") or mod == "lycoris.kohya"):
            c.unmapped.append(
                (_shown(name, v), "difftrain trains LoRA, DoRA, LoHa and LoKr (networks.lora*, lycoris.kohya)")
            )
    elif name == "network_args":
        for item in v if isinstance(v, list) else [v]:
            _network_arg(c, str(item))
    else:
        return False
    return True


def _network_arg(c: Conversion, item: str) -> None:
    k, eq, val = item.partition("=")
    k, val = k.strip(), val.strip()
    if not eq:
        c.unmapped.append((f"--network_args {item}", "value not understood (key=value)"))
    elif k == "algo":
        algo = {"lora": "lora", "locon": "lora", "loha": "loha", "lokr": "lokr"}.get(val.lower())
        if algo:
            c.set("lora.type", algo)
        else:
            c.unmapped.append((f"--network_args {item}", "difftrain's adapters are lora (locon), loha and lokr"))
    elif k in ("dora_wd", "use_dora"):
        c.set("lora.use_dora", _bool(val))
    elif k == "factor":
        try:
            c.set("lora.factor", int(val))
        except ValueError:
            c.unmapped.append((f"--network_args {item}", "value not understood"))
    elif k in ("decompose_both", "full_matrix", "use_tucker", "use_cp"):  # use_cp: LyCORIS' old name of use_tucker
        c.set(f"lora.{'use_tucker' if k == 'use_cp' else k}", _bool(val))
    elif k in ("rank_dropout", "module_dropout"):
        try:
            c.set(f"lora.{k}", float(val))
        except ValueError:
            c.unmapped.append((f"--network_args {item}", "value not understood"))
    elif k in NETWORK_ARGS_MISSING:
        c.unmapped.append((f"--network_args {item}", "no such lora setting in difftrain (LyCORIS / sd-scripts only)"))
    else:
        c.unmapped.append((f"--network_args {item}", UNKNOWN))


def _sample_prompts(c: Conversion, path: Path, guidance: bool) -> None:
    """sd-scripts' --sample_prompts file (library/train_util.py load_prompts): a .txt of one prompt a line with
    ``--w --h --d --l --g --s --n`` options, a .json list of such lines or of {prompt, width, height, seed, scale,
    guidance_scale, sample_steps, negative_prompt}, or a .toml ``[prompt]`` table with ``[[prompt.subset]]`` entries
    -> validation.*. ``guidance``: a guidance-distilled family, whose --g is the validation's guidance (else --l)."""
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            entries = json.loads(text)
            entries = entries if isinstance(entries, list) else [entries]
        elif path.suffix.lower() == ".toml":
            import tomllib

            table = tomllib.loads(text)["prompt"]
            entries = [{**{k: v for k, v in table.items() if k != "subset"}, **sub} for sub in table["subset"]]
        else:
            entries = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
        prompts = [_prompt_line(e) if isinstance(e, str) else {str(k): v for k, v in e.items()} for e in entries]
    except (
        OSError,
        UnicodeDecodeError,
        ValueError,
        AttributeError,
        KeyError,
        TypeError,
    ):  # tomllib's error: a ValueError
        c.unmapped.append(
            (
                f"--sample_prompts={path}",
                "its prompts could not be read (sd-scripts' .txt, .json or .toml prompt file): give validation.prompts",
            )
        )
        return
    c.set("validation.prompts", [str(p.get("prompt", "")) for p in prompts if p.get("prompt")])
    names = {
        "sample_steps": ("validation.num_inference_steps", int),
        "guidance_scale" if guidance else "scale": ("validation.guidance_scale", float),
        "seed": ("validation.seed", int),
    }
    for key, (dotted, conv) in names.items():
        seen = [conv(p[key]) for p in prompts if key in p]
        if seen:
            c.set(dotted, seen[0])
            if len(set(seen)) > 1:
                c.unmapped.append((f"--sample_prompts {key}", f"one {dotted} for every prompt: the first's is used"))
    sides = {int(p[k]) for p in prompts for k in ("width", "height") if k in p}
    if sides:
        side = max(sides)
        c.set("validation.resolution", max(64, side - side % 64))
        if len(sides) > 1:
            c.unmapped.append(
                ("--sample_prompts width/height", "validation samples are square: the largest side is used")
            )
    if any(p.get("negative_prompt") for p in prompts):
        c.unmapped.append(("--sample_prompts negative prompts", "validation samples have no negative prompt"))
    if any(p.get("sample_sampler") for p in prompts):
        c.unmapped.append(("--sample_prompts --ss", UNSUPPORTED["sample_sampler"][0]))


def _prompt_line(line: str) -> dict[str, Any]:
    """One line of sd-scripts' prompt .txt (train_util.line_to_prompt_dict):
    ``a dog --w 1024 --h 1024 --d 1 --l 7.5 --g 3.5 --s 28 --n blurry --ss euler_a``."""
    parts = line.split(" --")
    out: dict[str, Any] = {"prompt": parts[0].strip()}
    keys = {
        "w": "width",
        "h": "height",
        "d": "seed",
        "l": "scale",
        "g": "guidance_scale",
        "s": "sample_steps",
        "n": "negative_prompt",
        "ss": "sample_sampler",
    }
    for p in parts[1:]:
        k, _, val = p.strip().partition(" ")
        if k.lower() in keys:
            out[keys[k.lower()]] = val.strip()
    return out


def _convert_flow(c: Conversion, target: Registered, args: dict[str, Any]) -> None:
    """The timestep sampling of sd-scripts' flow scripts (library/flux_train_utils.py and sd3_train_utils.py
    get_noisy_model_input_and_timesteps) as difftrain's flow section, with sd-scripts' defaults where an option is
    absent, so the converted run draws its noise levels as the sd-scripts run would:

    FLUX.1 --timestep_sampling (default sigma): sigma -> --weighting_scheme's density (logit_normal, mode, else
    uniform) shifted by --discrete_flow_shift (3.0); uniform -> uniform, no shift; sigmoid -> sigmoid of N(0,
    --sigmoid_scale), no shift; shift -> the same, shifted by --discrete_flow_shift; flux_shift -> the same, shifted
    by the image's size (FLUX.1 [dev]'s scheduler: flow.shift left to the model). --guidance_scale (3.5).
    SD3: --weighting_scheme's density (default uniform) shifted by --training_shift (1.0).
    musubi-tuner (Wan): as FLUX.1's (training/parser_common.py), its --discrete_flow_shift 1.0 by default; its other
    samplings (qwen_shift, logsnr ...) are listed as not mapped."""
    ts = _str(args.get("timestep_sampling", "sigma"))
    scheme = _str(args.get("weighting_scheme", "uniform"))
    density = scheme if scheme in ("logit_normal", "mode") else "uniform"
    sigmoid_scale = _num(args.get("sigmoid_scale", 1.0))
    shift_opt, default_shift = target.sd_scripts_shift or ("discrete_flow_shift", 1.0)
    sd3 = shift_opt == "training_shift"  # SD3's scripts: the weighting scheme's density, shifted; no guidance
    shift = _num(args.get(shift_opt, default_shift))
    # sd-scripts' <prefix>shift sampling: the shift follows the image's size as FLUX.1 [dev]'s scheduler shifts it,
    # which is what difftrain's flow.shift left unset does for the guidance-distilled family (its dynamic shifting);
    # musubi-tuner's flux_shift on Wan is not that model's own shift, and is listed
    size_shift = f"{target.sd_scripts_prefix}shift" if target.sd_scripts_guidance else None
    if sd3 or ts == "sigma":
        c.set("flow.timestep_sampling", density)
        c.set("flow.shift", shift)
    elif ts == "uniform":
        c.set("flow.timestep_sampling", "uniform")
        c.set("flow.shift", 1.0)
    elif ts in ("sigmoid", "shift") or ts == size_shift:
        c.set("flow.timestep_sampling", "logit_normal")
        c.set("flow.logit_mean", 0.0)
        c.set("flow.logit_std", sigmoid_scale)
        if ts == "sigmoid":
            c.set("flow.shift", 1.0)
        elif ts == "shift":
            c.set("flow.shift", shift)
    else:
        c.unmapped.append(
            (
                f"--timestep_sampling={ts}",
                "difftrain draws sigma, uniform, sigmoid, shift and flux_shift (as sd-scripts)",
            )
        )
    if density == "logit_normal":
        for k in ("logit_mean", "logit_std"):
            if k in args:
                c.set(f"flow.{k}", _num(args[k]))
    if density == "mode" and "mode_scale" in args:
        c.set("flow.mode_scale", _num(args["mode_scale"]))
    if scheme in ("sigma_sqrt", "cosmap"):
        c.set("flow.loss_weighting", scheme)
    if sd3:  # sd3_train_network.py always preconditions: the loss of the denoised latents
        c.unmapped.append(
            (
                "(the SD3 scripts' loss)",
                "sd-scripts' SD3 compares denoised latents (x - sigma * pred with the latents): the velocity loss "
                "weighted by sigma^2; difftrain's SD3 takes the velocity loss itself (flow.loss_weighting to weight it)",
            )
        )
    if target.sd_scripts_guidance:
        c.set("flow.guidance_scale", _num(args.get("guidance_scale", 3.5)))
        if "t5xxl_max_token_length" not in args:  # FLUX.1's scripts: 512 for [dev], 256 for [schnell]
            schnell = "schnell" in str(args.get("pretrained_model_name_or_path", "")).lower()
            c.set("text_encoders.t5.max_length", 256 if schnell else 512)
    # FLUX.1's scripts default to sigma_scaled (the prediction turned into denoised latents, x - sigma * pred, then
    # compared with the velocity target: an objective of its own); raw is difftrain's
    mpt = _str(args.get("model_prediction_type", "sigma_scaled" if target.sd_scripts_guidance else "raw"))
    if mpt != "raw":
        c.unmapped.append((f"--model_prediction_type={mpt}", UNSUPPORTED["model_prediction_type"][0]))
    for k in ("min_timestep", "max_timestep"):
        if k in args:
            c.set(f"flow.{k}", _num(args[k]))
