"""The streaming load (issue 50): under the trainer's placement each tensor of a part goes where it will live as it
is read (fp8 on the device, a block-swap slab), for every layout, and the part ends exactly as the load before it
left it (loaded whole, then converted); a child process reading a file several times its RAM budget stays inside it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.errors import ModelLoadError
from difftrain.families import streaming
from difftrain.families.common import LazyTensors
from difftrain.families.flux import family as flux
from difftrain.families.flux import single_file as sf
from difftrain.families.registry import get_family
from difftrain.memory import fp8, int4, pinned
from difftrain.memory.block_swap import BlockSwap
from difftrain.memory.placement import WeightPlacement
from difftrain.utils import stream_save_safetensors

FP8_SWAP = ["memory.weights={kind: fp8}", "memory.activations={kind: checkpoint}",
            "memory.offload={kind: block_swap, blocks_to_swap: 2}"]  # fmt: skip


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory):
    """The tiny Flux as a diffusers folder and its transformer as a BFL single file."""
    root = tmp_path_factory.mktemp("stream-flux")
    fam = get_family("flux")
    folder = fam.build_tiny(root / "folder", seed=0)
    comps = fam.load(ModelConfig(path=folder), ["transformer"], tokenizers=False)
    tensors = LazyTensors(
        sf.to_single_file({"transformer": comps["transformer"].state_dict()}, fam.module_configs(comps))
    )
    stream_save_safetensors(root / "flux1.safetensors", tensors)
    return folder, root / "flux1.safetensors"


def _placement(family, sets, pin: bool = False) -> WeightPlacement:
    cfg = resolve(recipe="tiny-flux-lora", sets=sets).config
    p = WeightPlacement(cfg.memory, torch.device("cpu"), torch.bfloat16, [family.denoiser], family.denoiser,
                        keep=family.high_precision_modules, units=family.swap_blocks)  # fmt: skip
    p.pinned = pin  # off CUDA the store is pageable; pinned=True carves the same slabs from a stand-in (below)
    return p


def _slab_of(t: torch.Tensor) -> int | None:
    for i, (buf, _) in enumerate(pinned.budget().slabs):
        if buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel():
            return i
    return None


@pytest.mark.parametrize("layout", ["folder", "bfl-file"])
def test_the_streamed_flux_is_the_loaded_then_converted_one(flux_files, layout):
    folder, file = flux_files
    fam = get_family("flux")
    mcfg = ModelConfig(path=folder) if layout == "folder" else ModelConfig(path=file, config="flux-tiny")
    keep = fam.high_precision_modules.get("transformer", ())
    ref = fam.load(mcfg, ["transformer"], dtype=torch.bfloat16, device="cpu", tokenizers=False)["transformer"]
    fp8.convert(ref, torch.device("cpu"), skip=keep)  # the load before: whole, then converted layer by layer
    pinned.configure(None, pin=lambda n: torch.empty(n, dtype=torch.uint8))  # slabs, as on CUDA
    place = _placement(fam, FP8_SWAP, pin=True)
    with streaming.placing(place) as placed:
        got = fam.load(mcfg, ["transformer"], dtype=torch.bfloat16, device="cpu", tokenizers=False)["transformer"]
    assert placed == {"transformer"}
    a, b = ref.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].float(), b[k].float()), k
    assert [type(m) for m in ref.modules()] == [type(m) for m in got.modules()]
    fp8_layers = [m for m in got.modules() if isinstance(m, (fp8.Fp8Linear, fp8.Fp8Conv2d))]
    assert fp8_layers and all(m.compute_dtype == torch.bfloat16 for m in fp8_layers)
    # the swapped blocks' weights are in the slabs, block swap takes them as its home copies, and chooses the same
    units = fam.swap_blocks(got)
    assert place.swapped == BlockSwap(ref, fam.swap_blocks(ref), 2, "cpu").swapped
    in_slabs = {id(p) for i in place.swapped for p in units[i].parameters()}
    assert all(_slab_of(p) is not None for i in place.swapped for p in units[i].parameters())
    assert not any(_slab_of(p) is not None for p in got.parameters() if id(p) not in in_slabs)
    used = pinned.budget().used_bytes
    swap = BlockSwap(got, units, 2, "cpu", swapped=place.swapped)
    assert pinned.budget().used_bytes == used  # no second copy
    assert all(h is not None and _slab_of(h) is not None for i in swap.swapped for h in swap.home[i])
    pinned.configure(None)


def test_the_streamed_int4_flux_is_the_loaded_then_converted_one(flux_files):
    """memory.weights int4 streams as fp8 does: each Linear packed as it is read, the swapped blocks' codes in the
    pinned store; the part equals the one loaded whole and converted, tensor for tensor."""
    _, file = flux_files
    fam = get_family("flux")
    mcfg = ModelConfig(path=file, config="flux-tiny")
    keep = fam.high_precision_modules.get("transformer", ())
    ref = fam.load(mcfg, ["transformer"], dtype=torch.bfloat16, device="cpu", tokenizers=False)["transformer"]
    int4.convert(ref, torch.device("cpu"), 16, skip=keep)
    sets = ["memory.weights={kind: int4, group_size: 16}", *FP8_SWAP[1:]]
    with streaming.placing(_placement(fam, sets)) as placed:
        got = fam.load(mcfg, ["transformer"], dtype=torch.bfloat16, device="cpu", tokenizers=False)["transformer"]
    assert placed == {"transformer"}
    a, b = ref.state_dict(), got.state_dict()
    assert a.keys() == b.keys() and any(k.endswith("int4_scale") for k in a)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    layers = [m for m in got.modules() if isinstance(m, int4.Int4Linear)]
    assert len(layers) > 20 and all(m.compute_dtype == torch.bfloat16 for m in layers)


def test_a_capped_pinned_store_falls_back_to_pageable_memory_and_says_so(flux_files, capsys):
    folder, _ = flux_files
    fam = get_family("flux")
    pinned.configure(2e-6, pin=lambda n: torch.empty(n, dtype=torch.uint8))  # 2 KiB: room for the smallest only
    place = _placement(fam, FP8_SWAP, pin=True)
    with streaming.placing(place):
        got = fam.load(ModelConfig(path=folder), ["transformer"], dtype=torch.bfloat16, device="cpu",
                       tokenizers=False)["transformer"]  # fmt: skip
    b = pinned.budget()
    assert b.pageable_bytes > 0 and b.pinned_bytes <= 2e-6 * 2**30 and len(b.warnings) == 1
    assert "memory.pinned_limit_gib" in capsys.readouterr().err
    units = fam.swap_blocks(got)
    assert any(_slab_of(p) is None for i in place.swapped for p in units[i].parameters())  # pageable ones
    pinned.configure(None)


def test_slab_views_keep_version_counters_of_their_own(flux_files):
    """A parameter made from a view of a slab must not share the slab's version counter (utils.own_parameter): an
    in-place write into one swapped weight would otherwise count as a change to every weight of its slab, and the
    backward through them would be refused (found on the H100 with block swap's write-back)."""
    folder, _ = flux_files
    fam = get_family("flux")
    pinned.configure(None, pin=lambda n: torch.empty(n, dtype=torch.uint8))
    place = _placement(fam, ["train.method=full", "memory.weights.kind=bf16", "memory.optimizer.kind=adafactor", "memory.fused_backward=true", "train.max_grad_norm=null", "memory.activations={kind: checkpoint}",
                             "memory.offload={kind: block_swap, blocks_to_swap: 2}"], pin=True)  # fmt: skip
    with streaming.placing(place):
        got = fam.load(ModelConfig(path=folder), ["transformer"], dtype=torch.bfloat16, device="cpu",
                       tokenizers=False)["transformer"]  # fmt: skip
    ps = [p for i in place.swapped for p in fam.swap_blocks(got)[i].parameters()]
    slab = _slab_of(ps[0])
    same = [p for p in ps if _slab_of(p) == slab]
    assert len(same) > 1
    before = [p._version for p in same]
    with torch.no_grad():
        same[0].data.add_(1)  # as block swap's write-back copies into a home tensor
    assert [p._version for p in same[1:]] == before[1:]
    pinned.configure(None)


def test_a_wrong_shape_in_a_streamed_file_names_the_tensor(flux_files, tmp_path):
    from safetensors.torch import load_file, save_file

    _, file = flux_files
    sd = load_file(file)
    sd["double_blocks.0.img_mlp.0.weight"] = sd["double_blocks.0.img_mlp.0.weight"][:-1]
    save_file(sd, tmp_path / "bad.safetensors")
    fam = get_family("flux")
    with streaming.placing(_placement(fam, FP8_SWAP)), pytest.raises(ModelLoadError, match="size mismatch") as e:
        fam.load(ModelConfig(path=tmp_path / "bad.safetensors", config="flux-tiny"), ["transformer"],
                 dtype=torch.bfloat16, tokenizers=False)  # fmt: skip
    assert "bad.safetensors" in e.value.message and "transformer_blocks.0.ff.net.0.proj.weight" in e.value.message


def test_the_sdxl_single_file_streams_its_unet_as_the_folder_loads(tiny_model, tmp_path):
    fam = get_family("sdxl")
    comps = fam.load(ModelConfig(path=tiny_model), list(fam.parts), tokenizers=False)
    file = tmp_path / "sdxl.safetensors"
    fam.save_single_file({p: comps[p].state_dict() for p in fam.parts}, fam.module_configs(comps), file)
    cfg = resolve(recipe="tiny-sdxl-lora", sets=["memory.weights={kind: fp8}"]).config
    place = WeightPlacement(cfg.memory, torch.device("cpu"), torch.bfloat16, ["unet"], "unet",
                            keep=fam.high_precision_modules)  # fmt: skip
    mcfg = ModelConfig(path=file, config="sdxl-tiny")
    with streaming.placing(place) as placed:
        got = fam.load(mcfg, ["unet", "vae"], dtype=torch.bfloat16, device="cpu")
    assert placed == {"unet"}  # the VAE is not the placement's: loaded as before
    ref = fam.load(ModelConfig(path=tiny_model), ["unet"], dtype=torch.bfloat16, device="cpu")["unet"]
    fp8.convert(ref, torch.device("cpu"), skip=fam.high_precision_modules.get("unet", ()))
    a, b = ref.state_dict(), got["unet"].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
    assert any(isinstance(m, fp8.Fp8Conv2d) for m in got["unet"].modules())
    # a conv LoRA over an fp8 conv gets plain convs (peft builds them as type(base_layer)(...))
    from difftrain.config.schema import LoraConfig as LoraSettings
    from difftrain.lora.adapters import add_lora

    params = add_lora(got["unet"], LoraSettings(rank=2), ["conv1"])
    assert params and all(p.dtype == torch.float32 for p in params)
    lora_convs = [m for n, m in got["unet"].named_modules() if ".lora_A." in n + "." and isinstance(m, torch.nn.Conv2d)]
    assert lora_convs and all(type(m) is torch.nn.Conv2d for m in lora_convs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sets",
    [
        FP8_SWAP,
        [
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer.kind=adafactor",
            "memory.fused_backward=true",
            "train.max_grad_norm=null",
            "memory.activations={kind: checkpoint}",
            "memory.offload={kind: block_swap, blocks_to_swap: 2}",
        ],
        ["memory.weights={kind: int4, group_size: 16}", *FP8_SWAP[1:]],
    ],
    ids=["fp8-lora-swap", "bf16-full-swap-fused", "int4-lora-swap"],
)
def test_training_after_the_streamed_load_is_the_training_after_the_load_before(
    flux_files, _dataset_master, tmp_path, monkeypatch, sets
):
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import Trainer

    folder, _ = flux_files
    runs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("DIFFTRAIN_STREAMING_LOAD", mode)
        more = {"train.max_steps": 3, "report.to": "[]", "save.formats": "[]", "data.cache_dir": tmp_path / "cache",
                "train.mixed_precision": "bf16"}  # fmt: skip
        cfg = resolve(recipe="tiny-flux-lora", sets=tiny_sets(folder, _dataset_master, tmp_path / mode, **more) + sets)
        precompute(cfg.config)
        t = Trainer(cfg.config)
        r = t.run()
        den = t.parts.comps["transformer"]
        runs[mode] = (r.losses, {n: p.detach().float().clone() for n, p in den.named_parameters()})
    assert runs["1"][0] == runs["0"][0]
    assert all(torch.equal(runs["1"][1][n], runs["0"][1][n]) for n in runs["0"][1])


CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from difftrain.config.schema import ModelConfig
    from difftrain.families import common, streaming
    from difftrain.families.flux import family as flux, single_file as sf
    from difftrain.families.registry import get_family
    from difftrain.utils import SafetensorsReader, fix_malloc_mmap_threshold, set_tensor

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    fix_malloc_mmap_threshold()  # as the trainer sets it before loading
    path, stream = Path(sys.argv[1]), sys.argv[2] == "1"
    fam = get_family("flux")

    class Nowhere:  # a placement that keeps nothing (a one-element tensor expanded to the shape): what the load
        # itself holds is then all the RSS shows
        def takes(self, part):
            return stream

        def put_for(self, part, module):
            return lambda root, name, t: set_tensor(root, name, torch.zeros((), dtype=t.dtype).expand(t.shape))

    place = Nowhere()
    base = status("VmRSS")
    with streaming.placing(place):
        if path.is_dir():  # a diffusers folder, through the family's load
            m = fam.load(ModelConfig(path=path), ["transformer"], dtype=torch.bfloat16, device="cpu",
                         tokenizers=False)["transformer"]
        else:  # a BFL file of these blocks (no bundled architecture has them): its converter and the fill directly
            config = json.loads(Path(sys.argv[3]).read_text())
            with torch.device("meta"):
                m = flux._new_module("transformer", config)
            f = SafetensorsReader(path)
            read = lambda k: f.get_tensor(k).to(torch.bfloat16)
            tensors = sf.transformer_tensors(f.keys(), read, config)
            streaming.fill(m, "transformer", tensors, ValueError, common.assign_state_dict)
    print(json.dumps({"base": base, "hwm": status("VmHWM"), "params": sum(p.numel() for p in m.parameters())}))
    """
)


@pytest.mark.slow
def test_a_child_loading_a_file_several_times_its_budget_stays_inside_it(tmp_path):
    """A Flux transformer at real width (3072; 4 double and 8 single blocks, 2.5 GiB in bf16) read as a diffusers
    folder and as a BFL single file by a child process whose placement keeps nothing:
    its peak RSS grows by less than a quarter of the file, where the load before grew by the whole of it."""
    cfg = flux._read_json(flux.bundled_config_dir("flux-dev") / "transformer" / "config.json")
    cfg.update(num_layers=4, num_single_layers=8)
    with torch.device("meta"):
        meta = flux._new_module("transformer", cfg)
    # constant weights written one tensor at a time: the test's own RAM stays small too
    shapes = {k: v.shape for k, v in meta.state_dict().items()}
    sd = LazyTensors({k: (lambda s=s: torch.full(s, 0.01, dtype=torch.bfloat16)) for k, s in shapes.items()})
    folder = tmp_path / "wide" / "transformer"
    folder.mkdir(parents=True)
    stream_save_safetensors(folder / "diffusion_pytorch_model.safetensors", sd)
    (folder / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", **cfg}))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    bfl = tmp_path / "wide.safetensors"
    stream_save_safetensors(bfl, LazyTensors(sf.to_single_file({"transformer": sd}, {"transformer": cfg})))
    size = bfl.stat().st_size
    assert size > 2 * 2**30

    def child(path: Path, stream: bool) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-c", CHILD, str(path), "1" if stream else "0", str(tmp_path / "config.json")]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    for path in (folder.parent, bfl):
        got = child(path, True)
        assert got["params"] == sum(math.prod(s) for s in shapes.values())
        assert got["hwm"] - got["base"] < size / 4, (path, got, size)
    before = child(folder.parent, False)  # the load before: the whole model read into host memory
    assert before["hwm"] - before["base"] > 0.8 * size, (before, size)


def test_the_sd3_single_file_streams_its_transformer_as_diffusers_converter_reads_it(tmp_path):
    from difftrain.families.sd3 import single_file as sd3_sf
    from difftrain.utils import SafetensorsReader

    fam = get_family("sd3")
    folder = fam.build_tiny(tmp_path / "tiny-sd3", seed=0)
    comps = fam.load(ModelConfig(path=folder), list(fam.parts), tokenizers=False)
    file = tmp_path / "sd3.safetensors"
    fam.save_single_file({p: comps[p].state_dict() for p in fam.parts}, fam.module_configs(comps), file)
    config = fam.module_configs(comps)["transformer"]
    with SafetensorsReader(file) as f:
        in_file = f.keys()  # a list (SafetensorsReader is not a mapping)
        keys = [k for k in in_file if k.startswith(sd3_sf.PREFIXES["transformer"])]
        eager = sd3_sf.original_to_diffusers("transformer", {k: f.get_tensor(k) for k in keys}, config)
        reads = []
        streamed = dict(
            sd3_sf.transformer_tensors(keys, f.get_shape, lambda k: reads.append(k) or f.get_tensor(k), config)
        )
    assert sorted(reads) == sorted(keys)  # each file tensor read once
    assert streamed.keys() == eager.keys() and all(torch.equal(streamed[k], eager[k]) for k in eager)
    # through the family's load under an fp8 placement: the loaded-then-converted transformer, bitwise
    cfg = resolve(recipe="tiny-sd3-lora", sets=["memory.weights={kind: fp8}"]).config
    place = WeightPlacement(cfg.memory, torch.device("cpu"), torch.bfloat16, ["transformer"], "transformer",
                            keep=fam.high_precision_modules)  # fmt: skip
    mcfg = ModelConfig(path=file, config="sd3-tiny", tokenizer_path=folder)
    with streaming.placing(place) as placed:
        got = fam.load(mcfg, ["transformer"], dtype=torch.bfloat16, device="cpu")["transformer"]
    assert placed == {"transformer"}
    ref = fam.load(ModelConfig(path=folder), ["transformer"], dtype=torch.bfloat16, device="cpu")["transformer"]
    fp8.convert(ref, torch.device("cpu"), skip=fam.high_precision_modules.get("transformer", ()))
    a, b = ref.state_dict(), got.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_streamed_bitsandbytes_layers_are_the_loaded_then_converted_ones(flux_files, kind, monkeypatch):
    """nf4 / int8 base weights stream too (issue 50): each Linear becomes its bitsandbytes layer as its weight is
    read, the layer convert() makes from the loaded model (bitsandbytes quantizes on the CPU as on the GPU; the
    trainer still asks for a GPU, bnb_weights.require, stubbed here)."""
    pytest.importorskip("bitsandbytes")
    from difftrain.memory import bnb_weights

    monkeypatch.setattr(bnb_weights, "require", lambda kind, device: None)
    _, file = flux_files
    fam = get_family("flux")
    mcfg = ModelConfig(path=file, config="flux-tiny")
    keep = fam.high_precision_modules.get("transformer", ())
    ref = fam.load(mcfg, ["transformer"], dtype=torch.bfloat16, device="cpu", tokenizers=False)["transformer"]
    ref.requires_grad_(False)
    n = bnb_weights.convert(ref, torch.device("cpu"), kind, torch.bfloat16, skip=keep)  # the load before
    place = _placement(fam, [f"memory.weights={{kind: {kind}}}"])
    assert place.takes("transformer")
    with streaming.placing(place) as placed:
        got = fam.load(mcfg, ["transformer"], dtype=torch.bfloat16, device="cpu", tokenizers=False)["transformer"]
    assert placed == {"transformer"}
    layer = (torch.nn.Linear,)
    made = [m for m in got.modules() if isinstance(m, layer) and type(m) is not torch.nn.Linear]
    assert n > 0 and len(made) == n
    assert [type(m) for m in ref.modules()] == [type(m) for m in got.modules()]
    a, b = ref.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].float(), b[k].float()), k
    # the high-precision modules stayed plain Linears, and nothing is left on the meta device
    assert not any(t.is_meta for t in [*got.parameters(), *got.buffers()])
    # convert() after the streamed load (what the trainer's technique still runs) makes no second layer
    got.requires_grad_(False)
    assert bnb_weights.convert(got, torch.device("cpu"), kind, torch.bfloat16, skip=keep) == 0
