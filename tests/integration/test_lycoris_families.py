"""LoHa, LoKr and DoRA through the trainer on every family's tiny model (issue 54; SDXL in
test_lycoris_training.py): two steps each, the kohya/LyCORIS file written where the family has kohya names (LoKr
kept off the q/k/v that Flux's and Z-Image's names fuse), and a DoRA's diffusers file loading into the family's
diffusers pipeline as DoRA. CogVideoX (no kohya layout) refuses LoHa and LoKr before loading anything."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from difftrain.config.load import resolve
from difftrain.errors import ConfigError
from difftrain.families.registry import get_family
from difftrain.flows.quickstart import _flow_sets, make_clips, make_dataset, quickstart_families
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train

KINDS = {"loha": {"lora.type": "loha"}, "lokr": {"lora.type": "lokr"}, "dora": {"lora.use_dora": "true"}}
FAMILIES = [n for n in quickstart_families() if n != "sdxl"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per family: its tiny model and a dataset (clips for video families), built once."""
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            fam = get_family(name)
            root = tmp_path_factory.mktemp(name)
            data = make_clips(root / "data") if fam.video else make_dataset(root / "data", n=4)
            if fam.references:  # Edit: each target's reference, a copy of it by the same name
                shutil.copytree(data, root / "control")
            made[name] = (fam.build_tiny(root / "model", seed=0), data, root)
        return made[name]

    return get


def _lokr_targets(fam, cfg) -> list[str]:
    """The recipe's targets less those the family's kohya names fuse (a LoKr cannot be written there)."""
    fused = {m.rpartition(".")[2] for g in fam.kohya_fused(cfg.model, fam.denoiser).values() for m, _ in g[0]}
    return [t for t in cfg.lora.targets if t.rpartition(".")[2] not in fused]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", FAMILIES)
def test_each_adapter_trains_on_the_familys_tiny_model(built, name, kind, tmp_path):
    model, data, root = built(name)
    fam = get_family(name)
    recipe, family_sets = _flow_sets(name)
    sets = [
        *family_sets,
        f"model.path={model}",
        f"data.dir={data}",
        f"data.cache_dir={root / 'cache'}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=2",
        "lora.rank=4",
        *(f"{k}={v}" for k, v in KINDS[kind].items()),
        *([f"data.control_dir={root / 'control'}"] if fam.references else []),
    ]
    cfg = resolve(recipe=recipe, sets=sets).config
    precompute(cfg)
    if kind == "lokr" and _lokr_targets(fam, cfg) != cfg.lora.targets:
        with pytest.raises(ConfigError, match="rows of several Kronecker products"):
            train(cfg)
        cfg = resolve(recipe=recipe, sets=[*sets, f"lora.targets=[{', '.join(_lokr_targets(fam, cfg))}]"]).config
    if kind != "dora" and not fam.kohya_layout:
        with pytest.raises(ConfigError, match="diffusers does not load"):
            train(cfg)
        assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("*.safetensors"))
        return
    r = train(cfg)
    assert len(r.losses) == 2 and all(torch.isfinite(torch.tensor(r.losses)))
    folder = r.lora_path.parent
    if fam.kohya_layout:
        sd = load_file(folder / "lora_kohya.safetensors")
        leaves = {k.rpartition(".")[2] for k in sd}
        want = {"loha": "hada_w1_a", "lokr": "lokr_w1", "dora": "dora_scale"}[kind]
        assert want in leaves, sorted(leaves)
    if fam.mergeable and fam.kohya_layout:
        # peft's side from the diffusers file where there is one (Krea 2's own-names file folds its alpha in)
        trained = folder / "pytorch_lora_weights.safetensors"
        trained = trained if trained.exists() else folder / "lora_kohya.safetensors"
        _merge_matches_peft(fam, cfg, model, folder / "lora_kohya.safetensors", trained, tmp_path)
    if kind == "dora":
        from diffusers import DiffusionPipeline

        # the folder's processor, as transformers reads it, needs torchvision (an Edit pipeline's image processor,
        # Qwen3VLProcessor's video half), which the LoRA loader does not: the family's own processor in its place
        # (torchvision-free; QwenImage21Pipeline's constructor reads its chat template, so None will not do)
        skip = {}
        if "processor" in json.loads((model / "model_index.json").read_text()):
            from difftrain.config.schema import ModelConfig

            skip = {"processor": fam.load(ModelConfig(path=model), ["text_encoder"])["processor"]}
        pipe = DiffusionPipeline.from_pretrained(str(model), local_files_only=True, **skip)
        pipe.load_lora_weights(str(folder), weight_name="pytorch_lora_weights.safetensors")
        denoiser = getattr(pipe, fam.denoiser)
        assert any("lora_magnitude_vector" in n for n, _ in denoiser.named_parameters())
    else:
        assert not (folder / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "sets", "needle"),
    [
        ("flux", ["lora.type=lokr"], "rows of several Kronecker products are no Kronecker product"),
        ("flux", ["lora.use_dora=true", "lora.targets=[to_q, to_k]"], "needs every one of them adapted"),
        ("cogvideox", ["lora.type=loha"], "diffusers does not load LoHa or LoKr"),
    ],
)
def test_the_console_script_refuses_an_unwritable_adapter_before_precompute(built, name, sets, needle, tmp_path):
    from conftest import clean_failure, script_train, set_args

    model, data, _ = built(name)
    recipe, family_sets = _flow_sets(name)
    base = [*family_sets, f"model.path={model}", f"data.dir={data}", f"data.cache_dir={tmp_path / 'cache'}"]
    r = script_train("--recipe", recipe, *set_args([*base, f"train.output_dir={tmp_path / 'run'}", *sets]))
    clean_failure(r, 2, needle)
    assert not (tmp_path / "cache").exists()  # nothing encoded, nothing written


def _merge_matches_peft(fam, cfg, model, lora, trained, tmp_path) -> None:
    """lora merge of the kohya/LyCORIS file ``lora`` gives the denoiser weights peft merges from the trained adapter
    (``trained``: a file of it peft loads)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from difftrain.config.schema import ModelConfig
    from difftrain.lora import files as lora_files
    from difftrain.lora.adapters import adapter_metadata, add_lora
    from difftrain.lora.tools import merge

    den = fam.denoiser
    layers, alphas = lora_files.read_lora_file(trained, cfg.model, fam, [den])
    m = fam.load(cfg.model, [den], dtype=torch.float32, tokenizers=False)[den]
    base = {k: v.clone() for k, v in m.state_dict().items()}
    add_lora(m, cfg.lora, cfg.lora.targets)
    lora_files.load_into(m, den, layers[den], alphas[den], adapter_metadata(m), trained)
    for layer in m.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.merge()
    want = {k.replace(".base_layer", ""): v for k, v in m.state_dict().items() if "lora_" not in k and "hada_" not in k}
    out = tmp_path / "merged.safetensors"
    merge(model, lora, out, family=fam.name, precision="fp32")
    got = fam.load(ModelConfig(path=out, config=cfg.model.config), [den], dtype=torch.float32, tokenizers=False)[den]
    got_sd = got.state_dict()
    changed = 0
    for k, w in want.items():
        if "lokr_" in k:
            continue
        torch.testing.assert_close(got_sd[k], w, rtol=1e-4, atol=1e-5, msg=k)
        changed += not torch.equal(got_sd[k], base[k])
    assert changed > 0
