"""convert-args: sd-scripts command lines and TOML configs become validated difftrain configs."""

from __future__ import annotations

import yaml

from difftrain.config.load import resolve
from difftrain.config.sdscripts import convert

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
    assert c.save.every_n_epochs == 5
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
    assert "fp8" in unmapped["--fp8_base"] and "--shuffle_caption" not in unmapped
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


def test_not_sdxl_script_is_flagged():
    c = convert(["train_network.py", "--network_dim=4"])
    assert any("only SDXL" in why for _, why in c.unmapped)
