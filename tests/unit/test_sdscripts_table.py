"""convert-args' table of sd-scripts options cannot go stale: every option sd-scripts defines is placed (mapped,
implied, unsupported with the nearest difftrain config, or without any equivalent), and every "unsupported" entry's
nearest config is shown not to validate. When difftrain grows one of them, its config validates and the test
below fails until the option is mapped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from difftrain.config import sdscripts as sds
from difftrain.config.load import resolve
from difftrain.errors import ConfigError
from difftrain.families import registry

FIXTURE = Path(__file__).parents[1] / "fixtures" / "sd_scripts_options.txt"
SD_OPTIONS = [line.strip() for line in FIXTURE.read_text().splitlines() if line.strip() and not line.startswith("#")]
#: one script of each family sd-scripts' scripts map to
SCRIPTS = [f"{r.sd_scripts_prefix}train_network.py" for r in registry.REGISTRY if r.sd_scripts_prefix]


def _dotted(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        node = out
        *head, last = key.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return out


def _validates(would_be: dict[str, Any]) -> bool:
    try:
        resolve(extra=_dotted({"train.method": "lora", **would_be}))
    except ConfigError:
        return False
    return True


def _stale(table: dict[str, tuple[str, dict[str, Any]]]) -> list[str]:
    """The unsupported options whose nearest difftrain config validates: difftrain has it now."""
    return [name for name, (_why, would_be) in table.items() if _validates(would_be)]


def test_every_unsupported_options_nearest_config_is_refused():
    assert _stale(sds.UNSUPPORTED) == []


def test_the_staleness_check_sees_an_option_difftrain_has():
    table = {"noise_offset": ("not available", {"train.noise_offset": 0.1}), **sds.UNSUPPORTED}
    assert _stale(table) == ["noise_offset"]


@pytest.mark.parametrize(
    ("table", "key"),
    [
        (sds.OPTIMIZERS_MISSING, "memory.optimizer.kind"),
        (dict.fromkeys(sds.SCHEDULERS_MISSING, None), "train.lr_scheduler"),
        (sds.LYCORIS_MISSING, "lora.type"),
    ],
    ids=["optimizer_type", "lr_scheduler", "network_args algo"],
)
def test_every_missing_value_is_refused_and_every_mapped_one_validates(table, key):
    for name, would in table.items():
        would_be = {key: would if would is not None else name}
        assert not _validates(would_be), f"{name}: {would_be} validates now: map it in config/sdscripts.py"
    if key == "memory.optimizer.kind":
        for name, opt in sds.OPTIMIZERS.items():
            assert _validates({f"memory.optimizer.{k}": v for k, v in opt.items()}), name
    if key == "train.lr_scheduler":
        for name in sds.SCHEDULERS:
            assert _validates({key: name}), name


def test_every_missing_network_arg_is_refused_and_the_mapped_ones_validate():
    stale = [k for k, would_be in sds.NETWORK_ARGS_MISSING.items() if _validates(would_be)]
    assert stale == []
    c = sds.convert(["sdxl_train_network.py", "--network_args", "algo=lokr", "factor=4", "decompose_both=True"])
    lora = resolve(extra=c.config).config.lora
    assert (lora.type, lora.factor, lora.decompose_both) == ("lokr", 4, True) and c.unmapped == []
    args = ["algo=loha", "rank_dropout=0.1", "module_dropout=0.05", "use_cp=True"]
    c = sds.convert(["sdxl_train_network.py", "--network_args", *args, "--network_dim=4"])
    lora = resolve(extra=c.config).config.lora
    assert (lora.type, lora.rank_dropout, lora.module_dropout, lora.use_tucker) == ("loha", 0.1, 0.05, True)
    assert c.unmapped == []


def test_the_tables_do_not_overlap():
    tables = [set(sds.SIMPLE), set(sds.IMPLIED), set(sds.UNSUPPORTED), set(sds.NO_EQUIVALENT)]
    for i, a in enumerate(tables):
        for b in tables[i + 1 :]:
            assert a & b == set()


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_sd_scripts_option_is_placed(script):
    """Each option of sd-scripts (the fixture lists them at the commit it names) is mapped or listed with a reason
    of its own: none falls through to 'no difftrain equivalent known'."""
    assert len(SD_OPTIONS) > 200
    unknown = []
    for name in SD_OPTIONS:
        if name in ("config_file", "dataset_config", "sample_prompts", "network_weights", "vae"):
            continue  # read files: each has its own test
        c = sds.convert([script, f"--{name}"])
        unknown += [opt for opt, why in c.unmapped if why == sds.UNKNOWN]
    assert unknown == []


def test_an_option_sd_scripts_lacks_is_said_unknown():
    c = sds.convert(["sdxl_train_network.py", "--made_up_flag=3"])
    assert c.unmapped == [("--made_up_flag=3", sds.UNKNOWN)]


FAMILIES = Path(registry.__file__).parent


@pytest.mark.parametrize("row", registry.REGISTRY, ids=lambda r: r.name)
def test_part_files_name_what_the_family_reads(row):
    """A registry row's part_files (what convert-args maps --vae / --ae / --clip_l / --t5xxl to) are the model.*
    file options its family's package reads, and only those."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in (FAMILIES / row.module).rglob("*.py"))
    for option in ("ae", "clip_l", "t5xxl", "text_encoder"):
        assert (option in row.part_files) == (f"model.{option}" in source), option


def test_options_that_mean_something_together():
    """sd-scripts' fused backward pass clips no global norm and is for full fine-tunes; its constant schedule has
    no warmup; a DDP option alone picks DDP: each converted so that the config validates, the difference listed."""
    c = sds.convert(["sdxl_train.py", "--optimizer_type=Adafactor", "--fused_backward_pass", "--lr_warmup_steps=10"])
    cfg = resolve(extra=c.config).config
    assert cfg.memory.fused_backward is True and cfg.train.max_grad_norm is None and cfg.train.warmup_steps == 0
    unmapped = dict(c.unmapped)
    assert "clips each tensor" in unmapped["--max_grad_norm"] and "no warmup" in unmapped["--lr_warmup_steps=10"]
    c = sds.convert(["sdxl_train_network.py", "--fused_backward_pass", "--ddp_static_graph", "--lr_scheduler=cosine"])
    cfg = resolve(extra=c.config).config
    assert cfg.memory.fused_backward is False and "--fused_backward_pass" in dict(c.unmapped)
    assert cfg.memory.engine.kind == "ddp" and cfg.memory.engine.static_graph is True


@pytest.mark.parametrize("kind", ["txt", "json", "toml"])
def test_sample_prompt_files(tmp_path, kind):
    """sd-scripts' three prompt-file forms (train_util.load_prompts) become validation's prompts and settings."""
    text = {
        "txt": "# a comment\na dog --w 768 --h 768 --d 7 --l 6.5 --s 20\na cat --W 768 --H 768 --d 7 --n blurry\n",
        "json": '[{"prompt": "a dog", "width": 768, "height": 768, "seed": 7, "scale": 6.5, "sample_steps": 20},'
        ' "a cat --w 768 --h 768 --d 7 --n blurry"]',
        "toml": "[prompt]\nwidth = 768\nheight = 768\nseed = 7\nsample_steps = 20\n"
        '[[prompt.subset]]\nprompt = "a dog"\nscale = 6.5\n[[prompt.subset]]\nprompt = "a cat"\n'
        'negative_prompt = "blurry"\n',
    }[kind]
    f = tmp_path / f"prompts.{kind}"
    f.write_text(text)
    c = sds.convert(["sdxl_train_network.py", f"--sample_prompts={f}", "--sample_every_n_steps=50"])
    v = resolve(extra=c.config).config.validation
    assert v.prompts == ["a dog", "a cat"] and (v.resolution, v.seed, v.guidance_scale) == (768, 7, 6.5)
    assert v.every_n_steps == 50 and v.num_inference_steps == 20
    assert dict(c.unmapped)["--sample_prompts negative prompts"]


def test_flux_prompt_guidance_and_an_unreadable_prompt_file(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a dog --g 3.5 --l 1.0 --s 20\n")
    c = sds.convert(["flux_train_network.py", f"--sample_prompts={f}"])
    assert resolve(extra=c.config).config.validation.guidance_scale == 3.5  # --g: FLUX.1 [dev]'s own guidance
    (tmp_path / "bad.toml").write_text("[prompt]\nwidth = 1\n")
    c = sds.convert(["sdxl_train_network.py", f"--sample_prompts={tmp_path / 'bad.toml'}"])
    assert (
        "validation" not in c.config
        and "could not be read" in dict(c.unmapped)[f"--sample_prompts={tmp_path / 'bad.toml'}"]
    )


def test_a_part_file_the_family_does_not_read_is_listed():
    """SDXL reads its VAE from model.path: sd-scripts' --vae is listed (model.ae would be ignored there), FLUX.1's
    --ae maps."""
    c = sds.convert(["sdxl_train_network.py", "--vae=sdxl_vae.safetensors"])
    assert "model" not in c.config and "file of its own" in dict(c.unmapped)["--vae=sdxl_vae.safetensors"]
    c = sds.convert(["flux_train_network.py", "--ae=ae.safetensors"])
    assert c.config["model"] == {"ae": "ae.safetensors"}


def test_flux_t5_length_follows_sd_scripts_default():
    dev = sds.convert(["flux_train_network.py", "--pretrained_model_name_or_path=flux1-dev.safetensors"])
    schnell = sds.convert(["flux_train_network.py", "--pretrained_model_name_or_path=flux1-schnell.safetensors"])
    given = sds.convert(["flux_train_network.py", "--t5xxl_max_token_length=128"])
    lengths = [resolve(extra=c.config).config.text_encoders.t5.max_length for c in (dev, schnell, given)]
    assert lengths == [512, 256, 128]
