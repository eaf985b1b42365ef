"""convert-args: sd-scripts command lines and TOML configs become validated difftrain configs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import CliResult, clean_failure, console_script
from difftrain.config.load import resolve
from difftrain.config.sdscripts import convert
from difftrain.families import registry

FULL = [
    "accelerate",
    "launch",
    "sdxl_train.py",
    "--pretrained_model_name_or_path=../model/sdxl1_0.safetensors",
    "--in_json",
    "../dataset/meta_lat.json",
    "--train_data_dir=../dataset/kohyas_finetune",
    "--output_dir=../train_result/model_out",
    "--save_model_as=safetensors",
    "--caption_extension=.txt",
    "--use_8bit_adam",
    "--train_batch_size=1",
    "--learning_rate=1e-5",
    "--max_train_epochs=10",
    "--train_text_encoder",
    "--xformers",
    "--gradient_checkpointing",
    "--mixed_precision=fp16",
    "--save_precision=fp16",
    "--enable_bucket",
    "--cache_latents",
    "--save_every_n_epochs=5",
    "--flip_aug",
]

LORA = [
    "accelerate",
    "launch",
    "--num_cpu_threads_per_process",
    "1",
    "sdxl_train_network.py",
    "--pretrained_model_name_or_path=sd_xl_base_1.0.safetensors",
    "--train_data_dir=img",
    "--output_dir=out",
    "--network_module=networks.lora",
    "--network_dim=32",
    "--network_alpha=16",
    "--network_train_unet_only",
    "--fp8_base",
    "--cache_text_encoder_outputs",
    "--optimizer_type=AdamW8bit",
    "--lr_scheduler=cosine",
    "--lr_warmup_steps=50",
    "--min_snr_gamma=5",
    "--noise_offset=0.0357",
    "--resolution=1024,1024",
    "--shuffle_caption",
    "--mixed_precision=bf16",
    "--max_train_steps=1600",
    "--save_every_n_steps=200",
]


def test_sdxl_train_command_maps_and_validates(cli):
    r = cli("convert-args", "--", *FULL)
    assert r.code == 0, r
    cfg = yaml.safe_load(r.out)
    c = resolve(extra=cfg).config
    assert c.train.method == "full" and c.model.path.name == "sdxl1_0.safetensors"
    assert str(c.data.metadata).endswith("meta_lat.json") and str(c.data.dir).endswith("kohyas_finetune")
    assert c.data.caption_ext == ".txt" and c.save.formats == ["single_file"] and c.save.precision == "fp16"
    assert c.memory.optimizer.kind == "adamw8bit" and c.memory.activations.kind == "checkpoint"
    assert (c.train.batch_size, c.train.learning_rate, c.train.epochs) == (1, 1e-5, 10)
    assert c.full.train_text_encoder_1 and c.full.train_text_encoder_2
    assert c.train.mixed_precision == "fp16" and c.memory.weights.kind == "fp32"  # fp32 master weights
    assert c.save.every_n_epochs == 5 and c.data.flip_aug is True
    for flag in ("--xformers", "--enable_bucket", "--cache_latents"):  # listed with the reason, not dropped
        assert flag in r.err
    assert "3 option(s) not mapped" in r.err


def test_lora_flags():
    c = convert(LORA)
    cfg = resolve(extra=c.config).config
    assert cfg.train.method == "lora" and (cfg.lora.rank, cfg.lora.alpha) == (32, 16.0)
    assert cfg.train.train_text_encoders is False
    assert (
        cfg.memory.optimizer.kind == "adamw8bit" and cfg.train.lr_scheduler == "cosine" and cfg.train.warmup_steps == 50
    )
    assert (cfg.train.min_snr_gamma, cfg.train.noise_offset) == (5.0, 0.0357)
    assert cfg.data.resolution == 1024 and cfg.train.max_steps == 1600 and cfg.train.checkpoint_every == 200
    unmapped = dict(c.unmapped)
    assert cfg.memory.weights.kind == "fp8" and "--fp8_base" not in unmapped and "--shuffle_caption" not in unmapped
    assert cfg.data.shuffle_caption is True and cfg.data.keep_tokens == 0
    assert "--cache_text_encoder_outputs" in unmapped  # mapped (frozen encoders) and explained


def test_lora_trains_text_encoders_unless_told_not_to():
    c = convert(["sdxl_train_network.py", "--network_module=networks.lora", "--network_dim=8"])
    assert resolve(extra=c.config).config.train.train_text_encoders is True


def test_unknown_and_unsupported_options_are_listed(cli):
    r = cli(
        "convert-args",
        "--",
        "sdxl_train.py",
        "--made_up_flag=3",
        "--optimizer_type=Prodigy",
        "--lr_scheduler=cosine_with_restarts",
    )
    assert r.code == 0
    for needle in ("--made_up_flag=3", "no difftrain equivalent", "--optimizer_type=Prodigy", "cosine_with_restarts"):
        assert needle in r.err


def test_toml_config(tmp_path):
    toml = tmp_path / "cfg.toml"
    toml.write_text(
        '[model]\npretrained_model_name_or_path = "m.safetensors"\n[training]\nlearning_rate = 2e-6\n'
        'train_batch_size = 4\ngradient_checkpointing = true\nfull_bf16 = true\nmixed_precision = "bf16"\n'
    )
    c = convert(["sdxl_train.py", "--config_file", str(toml)])
    cfg = resolve(extra=c.config).config
    assert cfg.train.learning_rate == 2e-6 and cfg.train.batch_size == 4 and cfg.memory.weights.kind == "bf16"
    assert cfg.memory.activations.kind == "checkpoint" and str(cfg.model.path) == "m.safetensors"
    c2 = convert([str(toml)])
    assert c2.config["train"]["learning_rate"] == 2e-6


def test_a_script_of_no_family_is_flagged():
    c = convert(["train_network.py", "--network_dim=4"])
    assert c.config["family"] == registry.sd_scripts_family().name
    assert any(opt == "train_network.py" and "difftrain maps these scripts" in why for opt, why in c.unmapped)


# ---------------------------------------------------------------- through the console script (issue 54)
def run(*args: object, cwd: Path | None = None) -> CliResult:
    env = {**os.environ, "COLUMNS": "250"}  # the tables unwrapped
    r = subprocess.run(
        [console_script(), *map(str, args)], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )
    return CliResult(r.returncode, r.stdout, r.stderr)


def _converted(r: CliResult):
    assert r.code == 0, r
    cfg = yaml.safe_load(r.out)
    return cfg, resolve(extra=cfg).config


def _unmapped(r: CliResult) -> str:
    return " ".join(r.err.split())


DATASET_TOML = """\
[general]
shuffle_caption = true
caption_extension = ".txt"
keep_tokens = 1

[[datasets]]
resolution = 1024
batch_size = 2

  [[datasets.subsets]]
  image_dir = "img/10_sks dog"
  class_tokens = "sks dog"
  num_repeats = 10
  flip_aug = true

  [[datasets.subsets]]
  image_dir = "reg/1_dog"
  class_tokens = "dog"
  is_reg = true
"""


def _dataset(tmp_path: Path) -> Path:
    (tmp_path / "ds.toml").write_text(DATASET_TOML)
    (tmp_path / "prompts.txt").write_text(
        "# sd-scripts' prompt file\n"
        "a photo of sks dog on a beach --w 1024 --h 1024 --d 1 --l 7.5 --s 28 --n blurry\n"
        "sks dog in the snow --w 1024 --h 768 --d 1 --s 28\n"
    )
    return tmp_path


@pytest.mark.slow
def test_sdxl_lora_with_dataset_config_samples_fp8_and_lokr(tmp_path):
    """sd-scripts' SDXL LoRA command line as its docs write one: the dataset TOML read into data.subsets, the sample
    prompts into validation, --fp8_base, LyCORIS' LoKr with --network_args given as several values; `difftrain plan`
    takes the result."""
    _dataset(tmp_path)
    r = run(
        "convert-args", "--", "accelerate", "launch", "--num_cpu_threads_per_process", "1", "sdxl_train_network.py",
        "--pretrained_model_name_or_path=sd_xl_base_1.0.safetensors", "--dataset_config", "ds.toml",
        "--output_dir", "out", "--network_module", "lycoris.kohya",
        "--network_args", "algo=lokr", "factor=4", "conv_dim=4",
        "--network_dim", "16", "--fp8_base", "--sample_prompts", "prompts.txt", "--sample_every_n_steps", "100",
        "--sample_sampler", "euler_a", "--prior_loss_weight", "0.5", "--cache_latents_to_disk",
        "--optimizer_type", "AdamW8bit", "--mixed_precision", "bf16", "--loss_type", "huber",
        cwd=tmp_path,
    )  # fmt: skip
    _, c = _converted(r)
    assert c.family == registry.sd_scripts_family().name and c.train.method == "lora"
    assert (c.lora.type, c.lora.factor, c.lora.rank) == ("lokr", 4, 16)
    assert c.memory.weights.kind == "fp8" and c.memory.optimizer.kind == "adamw8bit"
    assert c.train.batch_size == 2 and c.train.loss_type == "huber" and c.dreambooth.prior_loss_weight == 0.5
    subsets = {Path(s.dir).name: s for s in c.data.subsets}
    assert subsets["10_sks dog"].num_repeats == 10 and subsets["10_sks dog"].class_tokens == "sks dog"
    assert subsets["1_dog"].is_reg and subsets["10_sks dog"].keep_tokens == 1
    assert subsets["10_sks dog"].flip_aug is True and subsets["1_dog"].flip_aug is None  # the subset's own flip_aug
    assert c.validation.prompts == ["a photo of sks dog on a beach", "sks dog in the snow"]
    v = c.validation
    assert (v.every_n_steps, v.num_inference_steps, v.guidance_scale, v.seed, v.resolution) == (100, 28, 7.5, 1, 1024)
    text = _unmapped(r)
    for needle in (
        "--network_args conv_dim=4",
        "no such lora setting",
        "--sample_sampler=euler_a",
        "negative prompt",
        "--cache_latents_to_disk",
        "(implied)",
    ):
        assert needle in text, needle
    for gone in ("fp8 base weights are not available", "not available yet", "Unexpected argument", "flip_aug"):
        assert gone not in text
    (tmp_path / "out.yaml").write_text(r.out)
    p = run("plan", "--config", tmp_path / "out.yaml", cwd=tmp_path)
    assert p.code == 0, p
    assert "lora, batch 2, 1024px" in p.err


@pytest.mark.slow
def test_reg_data_dir_maps_to_the_kohya_regularisation_folder(tmp_path):
    r = run(
        "convert-args", "--", "sdxl_train_network.py", "--train_data_dir", "img", "--reg_data_dir", "reg",
        "--network_dim", "8", cwd=tmp_path,
    )  # fmt: skip
    _, c = _converted(r)
    assert str(c.data.reg_dir) == "reg" and str(c.data.dir) == "img"
    assert "--reg_data_dir" not in r.err


FLUX = [
    "accelerate", "launch", "--mixed_precision", "bf16", "--num_cpu_threads_per_process", "1",
    "flux_train_network.py", "--pretrained_model_name_or_path", "flux1-dev.safetensors",
    "--clip_l", "clip_l.safetensors", "--t5xxl", "t5xxl_fp16.safetensors", "--ae", "ae.safetensors",
    "--cache_latents_to_disk", "--save_model_as", "safetensors", "--sdpa", "--persistent_data_loader_workers",
    "--max_data_loader_n_workers", "2", "--seed", "42", "--gradient_checkpointing", "--mixed_precision", "bf16",
    "--save_precision", "bf16", "--network_module", "networks.lora_flux", "--network_dim", "4",
    "--network_train_unet_only", "--optimizer_type", "adamw8bit", "--learning_rate", "1e-4",
    "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk", "--fp8_base", "--highvram",
    "--max_train_epochs", "4", "--save_every_n_epochs", "1", "--dataset_config", "ds.toml", "--output_dir", "out",
    "--output_name", "flux-lora-name", "--timestep_sampling", "shift", "--discrete_flow_shift", "3.1582",
    "--model_prediction_type", "raw", "--guidance_scale", "1.0", "--blocks_to_swap", "18",
    "--t5xxl_max_token_length", "512", "--apply_t5_attn_mask",
]  # fmt: skip


@pytest.mark.slow
def test_flux_lora_command_from_sd_scripts_readme(tmp_path):
    """sd-scripts' FLUX.1 LoRA example (docs/flux_train_network.md) with block swap: the parts' own files, the
    timestep sampling as difftrain's flow section, guidance, fp8 and block swap."""
    _dataset(tmp_path)
    r = run("convert-args", "--", *FLUX, cwd=tmp_path)
    _, c = _converted(r)
    flux = registry.sd_scripts_family("flux_train_network.py")
    assert flux is not None and c.family == flux.name
    assert (c.model.path.name, c.model.clip_l.name, c.model.t5xxl.name, c.model.ae.name) == (
        "flux1-dev.safetensors",
        "clip_l.safetensors",
        "t5xxl_fp16.safetensors",
        "ae.safetensors",
    )
    # shift: sigmoid of N(0, sigmoid_scale 1.0), shifted by 3.1582
    f = c.flow
    assert (f.timestep_sampling, f.logit_mean, f.logit_std, f.shift, f.guidance_scale) == (
        "logit_normal",
        0.0,
        1.0,
        3.1582,
        1.0,
    )
    assert c.memory.offload.kind == "block_swap" and c.memory.offload.blocks_to_swap == 18
    assert c.memory.weights.kind == "fp8" and c.memory.activations.kind == "checkpoint"
    assert c.text_encoders.t5.max_length == 512 and c.train.train_text_encoders is False
    text = _unmapped(r)
    assert "--apply_t5_attn_mask" in text and "--output_name=flux-lora-name" in text
    assert "--model_prediction_type" not in text  # raw: difftrain's own
    (tmp_path / "flux.yaml").write_text(r.out)
    p = run("plan", "--config", tmp_path / "flux.yaml", cwd=tmp_path)
    assert p.code == 0, p


@pytest.mark.slow
def test_flux_defaults_are_sd_scripts_own(tmp_path):
    """Options left out are sd-scripts' defaults: --timestep_sampling sigma over --discrete_flow_shift 3.0,
    --guidance_scale 3.5, and --model_prediction_type sigma_scaled, which difftrain lacks (listed)."""
    r = run("convert-args", "--", "flux_train_network.py", "--network_dim", "4", "--timestep_sampling", "flux_shift")
    _, c = _converted(r)
    assert (c.flow.timestep_sampling, c.flow.shift, c.flow.guidance_scale) == ("logit_normal", None, 3.5)
    assert c.text_encoders.t5.max_length == 512  # sd-scripts' for [dev] (256 for a schnell file)
    assert "--model_prediction_type=sigma_scaled" in _unmapped(r)
    r = run("convert-args", "--", "flux_train_network.py", "--network_dim", "4", "--weighting_scheme", "mode")
    _, c = _converted(r)
    assert (c.flow.timestep_sampling, c.flow.shift) == ("mode", 3.0)


@pytest.mark.slow
def test_sd3_lora_command(tmp_path):
    r = run(
        "convert-args", "--", "sd3_train_network.py", "--pretrained_model_name_or_path", "sd3.5_large.safetensors",
        "--clip_l", "clip_l.safetensors", "--clip_g", "clip_g.safetensors", "--t5xxl", "t5xxl_fp16.safetensors",
        "--weighting_scheme", "logit_normal", "--logit_std", "1.2", "--training_shift", "3.0",
        "--network_module", "networks.lora_sd3", "--network_dim", "8", "--blocks_to_swap", "10",
        "--t5xxl_max_token_length", "256", "--apply_lg_attn_mask", "--fp8_base",
    )  # fmt: skip
    _, c = _converted(r)
    sd3 = registry.sd_scripts_family("sd3_train_network.py")
    assert sd3 is not None and c.family == sd3.name
    assert (c.flow.timestep_sampling, c.flow.logit_std, c.flow.shift) == ("logit_normal", 1.2, 3.0)
    assert c.memory.offload.blocks_to_swap == 10 and c.text_encoders.t5.max_length == 256
    text = _unmapped(r)
    for opt in ("--clip_l=clip_l.safetensors", "--clip_g=clip_g.safetensors", "--t5xxl=t5xxl_fp16.safetensors"):
        assert opt in text
    assert "does not read this part from a file of its own" in text and "--apply_lg_attn_mask" in text


@pytest.mark.slow
def test_musubi_tuner_wan_command(tmp_path):
    r = run(
        "convert-args", "--", "accelerate", "launch", "src/musubi_tuner/wan_train_network.py", "--task", "i2v-14B",
        "--dit", "wan2.1_i2v_480p_14B_bf16.safetensors", "--vae", "wan_2.1_vae.safetensors",
        "--t5", "umt5_xxl.safetensors", "--clip", "clip_vision.safetensors", "--network_module", "networks.lora_wan",
        "--network_dim", "32", "--timestep_sampling", "shift", "--discrete_flow_shift", "5.0",
        "--blocks_to_swap", "20", "--fp8_base",
    )  # fmt: skip
    _, c = _converted(r)
    wan = registry.sd_scripts_family("wan_train_network.py")
    assert wan is not None and c.family == f"{wan.name}-i2v"
    assert (c.model.path.name, c.model.ae.name, c.model.t5xxl.name) == (
        "wan2.1_i2v_480p_14B_bf16.safetensors",
        "wan_2.1_vae.safetensors",
        "umt5_xxl.safetensors",
    )
    assert c.flow.shift == 5.0 and c.memory.offload.blocks_to_swap == 20
    assert "--clip=clip_vision.safetensors" in _unmapped(r)


@pytest.mark.slow
def test_several_values_and_bad_inputs_exit_codes(tmp_path):
    r = run("convert-args", "--", "sdxl_train.py", "--optimizer_args", "weight_decay=0.05", "betas=0.9,0.99", "foo=1")
    _, c = _converted(r)
    assert c.memory.optimizer.weight_decay == 0.05 and c.memory.optimizer.betas == (0.9, 0.99)
    assert "--optimizer_args foo=1" in _unmapped(r)
    clean_failure(
        run("convert-args", "--", "sdxl_train.py", "--dataset_config", "nope.toml", cwd=tmp_path),
        2,
        "nope.toml does not exist",
    )
    (tmp_path / "bad.toml").write_text('[[datasets]]\n[[datasets.subsets]]\nimage_dir = "x"\nbogus_key = 1\n')
    clean_failure(
        run("convert-args", "--", "sdxl_train.py", "--dataset_config", "bad.toml", cwd=tmp_path), 2, "bogus_key"
    )
    clean_failure(run("convert-args", "--", "sdxl_train.py", "stray", "--seed=1"), 2, "Unexpected argument 'stray'")
    # a value that does not validate: the conversion is refused as a config error, nothing printed as a config
    r = run("convert-args", "--", "sdxl_train_network.py", "--network_args", "algo=loha", "dora_wd=True")
    assert r.code == 2 and "lora.use_dora" in _unmapped(r) and "family:" not in r.out


def test_network_args_take_several_values(cli):
    """sd-scripts reads --network_args as nargs='*': `--network_args "algo=lokr" "factor=4"` (it stopped at
    'factor=4' before)."""
    r = cli(
        "convert-args", "--", "sdxl_train_network.py", "--network_module", "lycoris.kohya",
        "--network_args", "algo=lokr", "factor=4", "decompose_both=True", "conv_dim=4", "--network_dim", "8",
    )  # fmt: skip
    assert r.code == 0, r
    lora = resolve(extra=yaml.safe_load(r.out)).config.lora
    assert (lora.type, lora.factor, lora.decompose_both, lora.rank) == ("lokr", 4, True, 8)
    assert "--network_args conv_dim=4" in r.err and "no such lora setting" in r.err
    c = convert(["sdxl_train_network.py", "--network_args", "algo=locon", "dora_wd=True", "--network_dim=4"])
    lora = resolve(extra=c.config).config.lora
    assert lora.type == "lora" and lora.use_dora is True
