"""What the families share: bundled configs, model sources, checkpoint files, loading and saving parts,
fingerprints, T5 storage precisions and the planner's parameter counts.

Each helper takes what differs between families (names, subfolders, hints) as
arguments, so every family's messages keep naming that family.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib.util
import json
import math
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ..config.schema import ModelConfig
from ..errors import BackendUnavailable, ConfigError, ModelLoadError, UnsafeCheckpoint
from ..utils import DTYPES, SafetensorsReader, sha256_file, stream_save_safetensors
from . import streaming
from .tokenizers import clip_vocab_from_open_clip

PICKLE_EXTS = (".ckpt", ".pt", ".pth", ".bin")
#: storage precisions a T5 encoder may be quantized to (bitsandbytes, CUDA only)
QUANTIZED = ("int8", "nf4")
FOLDER_HINT = "Give the folder that holds model_index.json, or a single-file .safetensors checkpoint."
SDXL_FOLDER_HINT = "It has a unet/ folder: it looks like an SDXL model; set family: sdxl."
#: torch.compile's costs for a transformer of FLUX.1's size (speed/auto.py's CompileCost), measured on FLUX.1 (how:
#: flux/family.py): the figures the families of about its size that were not measured themselves take too (FLUX.2,
#: Krea 2, Qwen-Image 2.1); read-only, one mapping for all of them
FLUX_COMPILE_COST: Mapping[str, float] = MappingProxyType(
    {
        "cold_s": 50.0,
        "warm_s": 20.0,
        "saved_s": 0.8,
        "saved_s_no_graphs": 0.48,
        "dynamic_s": 60.0,
        "shape_s": 0.0,
        "record_s": 4.0,
    }
)
_T5_HINT = "set text_encoders.t5.precision: bf16"


# ------------------------------------------------------------------ bundled configs
def configs_root() -> Path:
    return Path(str(resources.files("difftrain") / "families" / "configs"))


def config_names(prefix: str) -> list[str]:
    """The bundled architectures whose names start with ``prefix``."""
    return sorted(p.name for p in configs_root().iterdir() if p.name.startswith(prefix) and p.is_dir())


def bundled_dir(name: str, label: str, known: Callable[[], list[str]], prefix: str = "") -> Path:
    """The bundled config folder ``name`` (which must start with ``prefix``); ``label`` and ``known()`` word the error."""
    d = configs_root() / name
    if not name.startswith(prefix) or not d.is_dir():
        raise ModelLoadError(
            f"No bundled {label} config named {name!r}.", hint=f"Use model.config: one of {', '.join(known())}."
        )
    return d


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def hf_config(cfg: dict) -> dict:
    """A transformers config dict without its bookkeeping keys (what the config class's constructor takes)."""
    return {
        k: v
        for k, v in cfg.items()
        if k not in ("architectures", "model_type", "_name_or_path", "transformers_version")
    }


def module_config(module) -> dict:
    cfg = module.config
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)


def module_configs(comps: Mapping[str, Any], parts: Sequence[str]) -> dict[str, dict]:
    return {part: module_config(comps[part]) for part in parts if part in comps}


# ------------------------------------------------------------------ model sources
def resolve_source(
    mcfg: ModelConfig,
    *,
    no_model_hint: str,
    missing_hint: str,
    check_folder: Callable[[Path], None],
    unrecognised_hint: str = "Use a .safetensors checkpoint or a diffusers folder.",
    parts: Sequence[str] = (),
) -> tuple[str, Path]:
    """model.path -> ("diffusers" | "single" | "pickle", path).

    ``check_folder`` raises if a folder is not one of the family's; pickle
    checkpoints are refused unless ``model.allow_pickle``.
    """
    if mcfg.path is None:
        raise ModelLoadError("No model was given.", hint=no_model_hint)
    p = Path(mcfg.path).expanduser()
    if not p.exists():
        from ..runtime.hub import parse_hub_id, resolve_model_path

        if parse_hub_id(mcfg.path) is not None:  # a Hub id (the CLI resolved it already; a sweep's trial, a library
            p = resolve_model_path(mcfg.path, parts)[0] or p  # caller reach it here): the HF cache, or fetched
    if not p.exists():
        raise ModelLoadError(f"The model path {p} does not exist.", hint=missing_hint)
    if p.is_dir():
        check_folder(p)
        for sub in sorted(d for d in p.iterdir() if d.is_dir()) if not mcfg.allow_pickle else ():
            pickled = [f.name for f in sub.iterdir() if f.suffix.lower() in PICKLE_EXTS]
            if pickled and not any(sub.glob("*.safetensors")):  # with both, the loaders read the .safetensors
                raise UnsafeCheckpoint(
                    f"{sub} holds its weights as pickle ({pickled[0]}); loading one can run arbitrary code, so difftrain "
                    "refuses it by default.",
                    hint="Convert it to .safetensors, or pass --allow-pickle (it is then read "
                    "with torch.load(weights_only=True)).",
                )
        return "diffusers", p
    if p.suffix.lower() == ".safetensors":
        return "single", p
    if p.suffix.lower() in PICKLE_EXTS:
        if not mcfg.allow_pickle:
            raise UnsafeCheckpoint(
                f"{p.name} is a pickle checkpoint; loading one can run arbitrary code, so difftrain refuses it by default.",
                hint="Convert it to .safetensors, or pass --allow-pickle (it is then read with torch.load(weights_only=True)).",
            )
        return "pickle", p
    raise ModelLoadError(f"Unrecognised model file {p.name}.", hint=unrecognised_hint)


def require_subfolder(p: Path, sub: str, label: str) -> None:
    """A diffusers folder of family ``label`` has ``sub``/ (its denoiser); else say what the folder looks like."""
    if not (p / sub).is_dir():
        hint = SDXL_FOLDER_HINT if (p / "unet").is_dir() else FOLDER_HINT
        raise ModelLoadError(
            f"{p} is a folder but not a diffusers {label} folder (it has no {sub}/ subfolder).", hint=hint
        )


def open_safetensors(p: Path) -> SafetensorsReader:
    """A reader of a user's .safetensors file (:class:`SafetensorsReader`: plain reads, no mapping whose pages would
    count in the RSS), its header checked first (an absurd header length is refused before anything is allocated);
    :class:`ModelLoadError` naming the file."""
    try:
        return SafetensorsReader(p)
    except Exception as e:  # noqa: BLE001 (the check's ValueError, OSError, safetensors' own error types)
        raise ModelLoadError(
            f"{p} is not a readable safetensors file: {str(e).replace(str(p), 'it')}",
            hint="Is the download complete? Download it again, or give another checkpoint.",
        ) from None


def open_checkpoint(kind: str, p: Path):
    """(keys, tensor reader, shape reader, header metadata) of a single file ("single": safetensors, memory-mapped;
    "pickle": torch.load with weights_only=True)."""
    if kind == "single":
        handle = open_safetensors(p)
        return (
            list(handle.keys()),
            handle.get_tensor,
            handle.get_shape,
            handle.metadata() or {},
        )
    try:  # weights_only: tensors and plain containers only, no code (a file that needs more is refused)
        state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 (UnpicklingError, RuntimeError for a file that is not a torch zip ...)
        raise ModelLoadError(
            f"{p} cannot be read as a torch checkpoint with weights_only=True: {str(e).splitlines()[0]}",
            hint="Convert it to .safetensors with the tool that made it.",
        ) from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ModelLoadError(f"{p} holds no state dict of tensors.", hint="Give the model's weights file.")
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return list(state.keys()), state.__getitem__, lambda k: tuple(state[k].shape), {}


# ------------------------------------------------------------------ loading
def check_parts(label: str, parts: Sequence[str], known: Sequence[str]) -> None:
    unknown = [part for part in parts if part not in known]
    if unknown:
        raise ModelLoadError(f"{label} has no part named {unknown[0]!r}.", hint=f"Parts: {', '.join(known)}.")


def load_diffusers_parts(
    p: Path,
    parts: Sequence[str],
    classes: Mapping[str, Any],
    dtypes: Mapping[str, torch.dtype],
    device,
    missing_hint: Callable[[str], str],
    quant: Mapping[str, str] | None = None,
    check_first: bool = False,
    subfolders: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Each part from its subfolder of a diffusers folder, straight to ``device`` (T5 parts in ``quant`` through bitsandbytes).

    A missing subfolder is named as its turn comes, or before anything is read with ``check_first``. ``subfolders``:
    a part read from another subfolder than its name (a two-expert model's transformer_2/ trained as the transformer).
    """
    quant = quant or {}

    def sub(part: str) -> str:
        return (subfolders or {}).get(part, part)

    def require(part: str) -> None:
        if not (p / sub(part)).is_dir():
            raise ModelLoadError(f"The diffusers folder {p} has no {sub(part)}/ subfolder.", hint=missing_hint(part))

    if check_first:
        for part in parts:
            require(part)
    out = {}
    for part in parts:
        require(part)
        for f in sorted((p / sub(part)).glob("*.safetensors")):
            open_safetensors(f).close()  # each file's header checked (and named) before the loaders read it
        if part not in quant and not _MAPPED_READS[0]:
            read = read_diffusers_model(p / sub(part), classes[part], dtypes[part], device, part)
            if read is not None:
                out[part] = read
                continue
        extra: dict[str, Any] = {}
        if torch.device(device).type == "cuda":
            # device_map: weights go to the GPU as they are read (no full host copy first)
            extra["device_map"] = {"": str(device)}
        if part in quant:
            extra["quantization_config"] = bnb_config(quant[part], dtypes[part])
        try:
            out[part] = classes[part].from_pretrained(
                p, subfolder=sub(part), torch_dtype=dtypes[part], local_files_only=True, **extra
            )
        except OSError as e:
            raise ModelLoadError(f"Could not load {part} from {p}: {e}") from None
    return out


#: whether ``load_diffusers_parts`` leaves every part to from_pretrained (safetensors' mapping): see mapped_reads
_MAPPED_READS = [False]


@contextlib.contextmanager
def mapped_reads() -> Iterator[None]:
    """Within it, diffusers folders are read through safetensors' mapping (from_pretrained), as before
    :func:`read_diffusers_model`. ZeRO-3's partitioned build wants that: its main process copies the weights to
    every GPU share from file pages the system can take back, instead of holding a private copy of the model."""
    _MAPPED_READS[0] = True
    try:
        yield
    finally:
        _MAPPED_READS[0] = False


def _diffusers_weight_files(sub: Path) -> list[Path] | None:
    """The safetensors files of a diffusers model folder (one file, or the shards its index names), else None."""
    one = sub / "diffusion_pytorch_model.safetensors"
    index = sub / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # from_pretrained words what is wrong with it
        files = [sub / n for n in names]
        return files if all(f.is_file() for f in files) else None
    return [one] if one.is_file() else None


def read_diffusers_model(
    sub: Path, cls: Any, dtype: torch.dtype, device, part: str | None = None
) -> torch.nn.Module | None:
    """A diffusers model from its folder ``sub`` with difftrain's :class:`SafetensorsReader`: built on the meta
    device, then each tensor read with plain reads, cast, moved to ``device`` and assigned.

    Why not from_pretrained: diffusers reads the files through safetensors' mapping, and on the CPU the weights it
    returns are views of that mapping, which lives until the last of them is dropped. Every page read stays in the
    RSS: FLUX.1's transformer loaded on the host for fp8 or block swap kept its 22 GiB of file pages beside the 11 GiB
    of fp8 copies made from them (35.2 GiB peak RSS for flux-lora-8gb on the H100). Read here, each tensor is private
    memory until it is assigned, or, under the trainer's placement (``streaming.placing``), until its destination (the
    GPU, an fp8 copy, a pinned block-swap slab) has it, before the next is read (benchmarks/host_load.py).

    Returns None (the caller uses from_pretrained, which also words its errors) for anything this does not cover:
    no safetensors weights, classes that are not diffusers models, or keys that are not exactly the model's (older
    layouts from_pretrained renames on load). ``part``: the part it is loaded as, where that is not the folder's
    name (a two-expert model's transformer_2/ trained as the transformer)."""
    files = _diffusers_weight_files(sub)
    if files is None or not hasattr(cls, "load_config") or not (sub / "config.json").is_file():
        return None
    from accelerate import init_empty_weights

    try:
        config = cls.load_config(sub)
        with init_empty_weights(include_buffers=False):
            module = cls.from_config(config)
    except Exception:  # noqa: BLE001 (a config this diffusers cannot build: from_pretrained says why)
        return None
    expected = set(module.state_dict())
    handles = [open_safetensors(f) for f in files]
    try:
        keys = [h.keys() for h in handles]
        if {k for ks in keys for k in ks} != expected:
            return None
        keep32 = getattr(cls, "_keep_in_fp32_modules", None) or []

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for h, ks in zip(handles, keys):
                for k in ks:
                    t = h.get_tensor(k)
                    if t.is_floating_point():
                        want = torch.float32 if any(m in k.split(".") for m in keep32) else dtype
                        t = t.to(device=device, dtype=want)
                    else:
                        t = t.to(device)
                    yield k, t
                    del t  # not held while the next one is read

        def mismatch(what: str) -> ModelLoadError:
            return ModelLoadError(f"The weights in {sub} do not fit its config.json: {what}")

        # one tensor at a time: gathered and assigned, or each sent where the trainer's placement says (streaming)
        streaming.fill(module, part or sub.name, tensors(), mismatch, assign_state_dict)
    finally:
        for h in handles:
            h.close()

    module.register_to_config(_name_or_path=sub.parent)  # as from_pretrained records it (model folder, subfolder)
    module.eval()
    return module


def freeze(comps: Mapping[str, Any], parts: Iterable[str], device, quant: Mapping[str, str] | None = None) -> None:
    """Frozen, in eval mode, on ``device`` (bitsandbytes modules are placed by device_map and refuse .to())."""
    for part in parts:
        comps[part].requires_grad_(False).eval()
        # a part the trainer's placement streamed is where it belongs (the GPU, fp8, pinned block-swap slabs)
        if part not in (quant or {}) and not streaming.is_placed(part):
            comps[part].to(device)


def assign_state_dict(
    module: torch.nn.Module, sd: Mapping[str, torch.Tensor], mismatch: Callable[[str], Exception]
) -> None:
    """Load ``sd`` into a module built on the meta device; ``mismatch(what)`` is raised if it does not fit exactly."""
    try:
        missing, unexpected = module.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatches
        raise mismatch(str(e).splitlines()[-1].strip()) from None
    streaming.check_complete(module, missing, unexpected, mismatch)


def check_file_fits(
    module: torch.nn.Module, names: Iterable[str], shape: Callable[[str], Any], mismatch: Callable[[str], Exception]
) -> None:
    """A file's tensors (by their names in the module, each file shape read by ``shape``) against a module built on
    the meta device, before a byte of weights is read: the same names, each of the module's shape; ``mismatch(what)``
    raised naming the first difference."""
    expected = {k: tuple(t.shape) for k, t in module.state_dict().items()}
    names = list(names)
    missing, unexpected = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
    if missing or unexpected:
        raise mismatch(f"missing {missing[:3]}, unexpected {unexpected[:3]}.")
    wrong = [f"{k}: {shape(k)} in the file, {expected[k]} in the config" for k in names if shape(k) != expected[k]]
    if wrong:
        raise mismatch(f"{wrong[0]}" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "") + ".")


def clean_diffusers_config(cfg: dict) -> dict:
    """A diffusers model config without its bookkeeping keys (``_diffusers_version``, ``_name_or_path`` ...), its
    ``_class_name`` kept: what a saved part's config.json holds."""
    return {k: v for k, v in cfg.items() if not k.startswith("_") or k == "_class_name"}


def offline_clip_tokenizers() -> Path:
    """A folder with tokenizer/ and tokenizer_2/: CLIP's real vocabulary, derived offline once (shared by SDXL and SD3)."""
    base = Path.home() / ".cache" / "difftrain" / "clip-tokenizer"
    if not (base / "tokenizer_2" / "vocab.json").exists():
        clip_vocab_from_open_clip(base / "tokenizer")
        clip_vocab_from_open_clip(base / "tokenizer_2", pad_token="!")
    return base


def fused_widths(
    module: torch.nn.Module, groups: Iterable[tuple[str, Sequence[str], bool]]
) -> dict[str, tuple[tuple[tuple[str, int], ...], bool]]:
    """A family's ``kohya_fused`` from its fused groups (kohya name, members in the order the fused weight stacks
    them, whether its output halves are swapped): each member with its output width, read from ``module``."""
    mods = dict(module.named_modules())
    return {name: (tuple((m, int(mods[m].weight.shape[0])) for m in members), swap) for name, members, swap in groups}


def adaptable_paths(module: torch.nn.Module, rename: Callable[[str], str | None] | None = None) -> dict[str, str]:
    """Path -> kohya path (``rename(path)``, or the path itself) of every Linear/Conv module a LoRA may adapt;
    modules ``rename`` has no name for are left out."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)):
            path = rename(name) if rename is not None else name
            if path is not None:
                out[name] = path
    return out


def clip_kohya_path(path: str) -> str:
    """A CLIP encoder's module path as sd-scripts names it: transformers < 5 nested the tower under
    ``text_model.`` (CLIPTextModel no longer does), and kohya files keep that spelling."""
    return "text_model." + path if path.split(".", 1)[0] in ("embeddings", "encoder", "final_layer_norm") else path


# ------------------------------------------------------------------ T5 storage precision
def t5_precisions(
    parts: Sequence[str],
    dtype: torch.dtype,
    precision: Mapping[str, str] | None,
    device,
    *,
    t5: str,
    label: str,
    loaded_before: str,
    encoder: str = "T5",
) -> tuple[dict, dict]:
    """Per part: the float dtype, and (for the big text encoder's part ``t5`` only) the bitsandbytes quantization,
    checked to be possible on ``device`` before a byte is read. ``label`` names the family, ``loaded_before`` what
    the encoder precedes, ``encoder`` the encoder in messages (T5, or Z-Image's Qwen3)."""
    dtypes, quant = dict.fromkeys(parts, dtype), {}
    for part, prec in (precision or {}).items():
        if part not in parts:
            continue
        if prec in QUANTIZED:
            if part != t5:
                raise ConfigError(f"{prec} storage is offered for {label}'s {encoder} encoder only, not for {part}.")
            quant[part] = prec
        elif prec in DTYPES:
            dtypes[part] = DTYPES[prec]
        else:
            raise ConfigError(f"Unknown precision {prec!r} for {part}.", hint="Use one of int8, nf4, bf16, fp16, fp32.")
    for prec in quant.values():
        check_quantization(prec, device, loaded_before, encoder)
    return dtypes, quant


#: the option that sets each big text encoder's precision, and its size in 16 bits
_ENCODER_OPTION = {
    "T5": ("text_encoders.t5.precision", "about 9.5 GB"),
    "Qwen3": ("text_encoders.llm.precision", "about 8 GB"),
}


def check_quantization(prec: str, device, loaded_before: str, encoder: str = "T5") -> None:
    """int8/nf4 go through bitsandbytes, which needs CUDA: refuse early, offering a float precision."""
    option, size = _ENCODER_OPTION.get(encoder, _ENCODER_OPTION["T5"])
    hint = _T5_HINT if encoder == "T5" else f"set {option}: bf16"
    dev = torch.device(device)
    if dev.type != "cuda":
        raise BackendUnavailable(
            f"{encoder} precision {prec} needs bitsandbytes on a CUDA GPU, but the {encoder} encoder would load on {dev}.",
            hint=f"{hint} ({size}; it is loaded on its own, before {loaded_before}), "
            "or precompute on a machine with a CUDA GPU.",
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise BackendUnavailable(
            f"{encoder} precision {prec} needs bitsandbytes, which is not installed.",
            hint=f"pip install 'difftrain[bnb]', or {hint}.",
        )


def bnb_config(prec: str, dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    if prec == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def quantized_t5_from_state_dict(
    sd: dict, config: dict, prec: str, dtype: torch.dtype, device, config_cls=None, model_cls=None
):
    """T5 from converted tensors (host memory) quantized by transformers' bitsandbytes integration (a single file's
    T5: SD3's, Flux's t5xxl file; ``config_cls`` / ``model_cls``: another T5, Wan's UMT5).

    Host RAM holds T5 in 16 bits while it loads (about 9.5 GB for T5-XXL); a
    diffusers folder avoids that (transformers then reads shard by shard).
    """
    from transformers import T5Config, T5EncoderModel

    return (model_cls or T5EncoderModel).from_pretrained(
        None,
        config=(config_cls or T5Config)(**hf_config(config)),
        state_dict=sd,
        torch_dtype=dtype,
        quantization_config=bnb_config(prec, dtype),
        device_map={"": str(device)},
    )


def single_file_reader(get: Callable[[str], torch.Tensor], dtype: torch.dtype, device, quantized: bool, t5_fp16: bool):
    """A reader of one part's tensors from a memory-mapped file: each goes to ``device`` in ``dtype`` on its own (fp8-
    stored files become ``dtype``); integer tensors keep their type. A part bitsandbytes quantizes stays in host
    memory, 16-bit as stored (others bf16), until transformers quantizes it on the GPU. ``t5_fp16``: T5 in fp16
    overflows in its feed-forward output, so ``.wo.`` weights stay fp32 (as transformers keeps them)."""

    def read(k: str) -> torch.Tensor:
        t = get(k)
        if not t.is_floating_point():
            return t.to("cpu" if quantized else device)
        if quantized:
            return t if t.dtype in (torch.float16, torch.bfloat16) else t.to(torch.bfloat16)
        return t.to(device=device, dtype=torch.float32 if t5_fp16 and ".wo." in k else dtype)

    return read


def scaled_fp8(keys: Sequence[str], get):
    """ComfyUI's "fp8_scaled" files keep a scale per Linear that multiplies its fp8 weight: ``scale_weight`` (with a
    ``scaled_fp8`` marker) in the older layout, ``weight_scale`` (one number, or one per output row) beside an
    ``input_scale`` in the newer. The keys that are weights, and a reader giving each one as its real value (float32
    where scaled, as stored otherwise); the input scales (an fp8 matmul's activation scale) are left out, as weights
    read up to 16 bits never use them."""
    scales = {k.removesuffix(".scale_weight") + ".weight": k for k in keys if k.endswith(".scale_weight")}
    scales.update({k.removesuffix(".weight_scale") + ".weight": k for k in keys if k.endswith(".weight_scale")})
    skipped = set(scales.values()) | {
        k for k in keys if k.rsplit(".", 1)[-1] in ("scaled_fp8", "input_scale", "scale_input") or k == "scaled_fp8"
    }

    def read(k: str) -> torch.Tensor:
        t = get(k)
        if k not in scales:
            return t
        scale = get(scales[k]).to(torch.float32)
        if scale.numel() > 1 and scale.numel() == t.shape[0]:
            scale = scale.reshape(-1, *([1] * (t.dim() - 1)))  # one per output row
        return t.to(torch.float32) * scale

    return [k for k in keys if k not in skipped], read


# ------------------------------------------------------------------ saving
def write_part(
    folder: Path,
    part: str,
    sd: Mapping[str, torch.Tensor],
    cfg: dict,
    dtype: torch.dtype | None,
    model: str | tuple[str, str],
) -> None:
    """One part of a diffusers folder: ``part``/config.json and its weights, atomically per file.

    ``model``: a diffusers model's class name, or (architecture, model_type) of
    a transformers model. Position ids are dropped, and T5's embedding, which is
    tied to shared.weight (transformers re-ties it on load).
    """
    (folder / part).mkdir()
    cfg = dict(cfg)
    sd = {k: v for k, v in sd.items() if not k.endswith("position_ids")}
    if isinstance(model, tuple):
        cfg.setdefault("architectures", [model[0]])
        cfg.setdefault("model_type", model[1])
        if model[1] == "t5":
            sd.pop("encoder.embed_tokens.weight", None)
        name = "model.safetensors"
    else:
        cfg.setdefault("_class_name", model)
        name = "diffusion_pytorch_model.safetensors"
    (folder / part / "config.json").write_text(json.dumps(cfg, indent=2, default=str), encoding="utf-8")
    stream_save_safetensors(folder / part / name, sd, metadata={"format": "pt"}, dtype=dtype)


def random_parts(
    new_module: Callable[[str, dict], torch.nn.Module], cfgdir: Path, parts: Iterable[str], device, seed: int
) -> dict[str, torch.nn.Module]:
    """Seeded random bf16 modules of a bundled architecture's ``parts``, built on ``device``."""
    torch.manual_seed(seed)
    with torch.device(device):
        return {part: new_module(part, read_json(cfgdir / part / "config.json")).to(torch.bfloat16) for part in parts}


def write_random_t5_folder(
    path: Path,
    cfgdir: Path,
    parts: Sequence[str],
    all_parts: Sequence[str],
    modules: Mapping[str, torch.nn.Module],
    write: Callable[[Path, str, dict, dict, torch.dtype | None], None],
) -> Path:
    """A diffusers folder of random ``modules`` (bf16) of a bundled architecture whose text encoder is a T5 (CogVideoX,
    Wan): the parts not written are null in model_index.json, an offline tiny T5 tokenizer goes with the text encoder,
    the bundled scheduler config is copied; atomically. ``write(folder, part, state dict, config, dtype)`` writes one."""
    from ..utils import atomic_dir
    from .tokenizers import tiny_t5_tokenizer

    index = read_json(cfgdir / "model_index.json")
    for part in all_parts:
        if part not in parts:
            index[part] = [None, None]
    if "text_encoder" not in parts:
        index["tokenizer"] = [None, None]
    with atomic_dir(Path(path)) as tmp:
        for part in parts:
            write(tmp, part, modules[part].state_dict(), module_config(modules[part]), torch.bfloat16)
        if "text_encoder" in parts:
            tiny_t5_tokenizer(tmp / "tokenizer")
        shutil.copytree(cfgdir / "scheduler", tmp / "scheduler")
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return Path(path)


def t5_tokenizer_folder(kind: str, p: Path, mcfg: ModelConfig) -> Path | None:
    """Where a T5-conditioned family's tokenizer is: a diffusers source's tokenizer/, else model.tokenizer_path (or its
    tokenizer/); None when a single file was given without one."""
    if kind == "diffusers":
        return p / "tokenizer"
    if mcfg.tokenizer_path is None:
        return None
    base = Path(mcfg.tokenizer_path).expanduser()
    return base / "tokenizer" if (base / "tokenizer").is_dir() else base


def load_t5_tokenizer(
    kind: str, p: Path, mcfg: ModelConfig, family: str, name: str, files: str, read_hint: str | None = None
):
    """A T5-conditioned family's tokenizer (CogVideoX's T5, Wan's UMT5) from ``t5_tokenizer_folder``, each way it can
    be missing or unreadable named; ``name`` the encoder ("T5"), ``files`` what a diffusers tokenizer/ holds."""
    from transformers import T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

    folder = t5_tokenizer_folder(kind, p, mcfg)
    if folder is None:
        raise ModelLoadError(
            f"A single-file {family} transformer carries no {name} tokenizer, and {name}'s vocabulary cannot be built "
            "offline.",
            hint=f"Set model.tokenizer_path to a {family} diffusers folder (or its tokenizer/ folder).",
        )
    if not folder.is_dir():
        raise ModelLoadError(
            f"No {name} tokenizer folder at {folder}.", hint=f"A {family} diffusers folder holds tokenizer/ ({files})."
        )
    try:
        return T5TokenizerFast.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 (tokenizers and the sentencepiece converter raise their own types)
        raise ModelLoadError(f"Could not read the {name} tokenizer in {folder}: {e}", hint=read_hint) from None


def save_t5_video_folder(
    folder: Path,
    sds: Mapping[str, Any],
    configs: Mapping[str, dict],
    src: tuple[str, Path],
    bundled: Path,
    mcfg: ModelConfig,
    write: Callable[[Path, str, dict, dict, torch.dtype | None], None],
    labels: Mapping[str, str],
    family_label: str,
    dtype: torch.dtype | None = None,
    copied: Sequence[str] = (),
) -> Path:
    """A full diffusers folder of a T5-conditioned transformer family (CogVideoX, Wan), atomically: the parts in ``sds``
    written, the VAE and the text encoder copied from the diffusers source when absent (they never train), and
    ``copied`` (Wan I2V's image encoder) copied where the source has them; the tokenizer from the source or
    model.tokenizer_path; the scheduler config and model_index.json from the source, else the bundled architecture."""
    from ..errors import CheckpointError
    from ..utils import atomic_dir

    src_kind, p = src
    if "transformer" not in sds:
        raise CheckpointError(f"save_diffusers needs the {family_label} transformer; none was given.")
    copies = {x: p / x for x in copied if src_kind == "diffusers" and (p / x).is_dir()}
    for part in ("vae", "text_encoder"):
        if part in sds:
            continue
        if src_kind == "diffusers" and (p / part).is_dir():
            copies[part] = p / part
        else:
            raise CheckpointError(
                f"save_diffusers needs the {labels[part]}: it was not given and {p.name} has none.",
                hint=f"Export from a run whose model.path is a diffusers {family_label} folder.",
            )
    tok = t5_tokenizer_folder(src_kind, p, mcfg)
    if tok is None or not tok.is_dir():
        raise CheckpointError(
            f"save_diffusers needs the {labels['text_encoder']}'s tokenizer folder, and none was found.",
            hint="Set model.tokenizer_path to the base model's diffusers folder.",
        )
    sched = p if src_kind == "diffusers" and (p / "scheduler").is_dir() else bundled
    index = p / "model_index.json" if src_kind == "diffusers" else bundled / "model_index.json"
    index = index if index.exists() else bundled / "model_index.json"
    with atomic_dir(Path(folder)) as tmp:
        for part, sd in sds.items():
            write(tmp, part, sd, configs[part], dtype)
        for part, d in copies.items():
            shutil.copytree(d, tmp / part)
        shutil.copytree(sched / "scheduler", tmp / "scheduler")
        shutil.copytree(tok, tmp / "tokenizer")
        shutil.copy(index, tmp / "model_index.json")
    return Path(folder)


# ------------------------------------------------------------------ fingerprints
def weight_files(folder: Path) -> list[Path]:
    """The weight files of a diffusers part folder, sorted."""
    return sorted(f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))


def hash_files(
    name: str,
    part: str,
    files: Iterable[Path],
    memo: dict[str, str],
    hash_file: Callable[[Path], str] = sha256_file,
    key_suffix: str = "",
) -> str:
    """A hash of ``files``' hashes; ``memo`` keeps each file's by path, size and mtime (plus ``key_suffix``)."""
    h = hashlib.sha256(f"{name}:{part}".encode())
    for f in files:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}{key_suffix}"
        if key not in memo:
            memo[key] = hash_file(f)
        h.update(memo[key].encode())
    return h.hexdigest()


def split_fingerprint(
    name: str, part: str, kind: str, files: Iterable[Path], memo: dict[str, str], prefixes: Mapping[str, str]
) -> str:
    """A part's fingerprint where a single file holds every part: only its tensors (keys under ``prefixes[part]``)
    are hashed, so a changed denoiser keeps the encoders' caches valid (a diffusers folder's files are hashed whole)."""
    if kind == "diffusers":
        return hash_files(name, part, files, memo, key_suffix="|")
    return hash_files(name, part, files, memo, lambda f: part_hash(kind, f, prefixes[part]), key_suffix=f"|{part}")


def part_hash(kind: str, f: Path, prefix: str) -> str:
    """Hash only the tensors under ``prefix`` of a safetensors file (the whole file otherwise)."""
    h = hashlib.sha256()
    if kind == "single":
        with open_safetensors(f) as handle:
            for k in sorted(k for k in handle.keys() if k.startswith(prefix)):  # noqa: SIM118 (safe_open is not a dict)
                t = handle.get_tensor(k)
                h.update(f"{k}|{t.dtype}|{tuple(t.shape)}".encode())
                h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # its buffer, not a copy
        return h.hexdigest()
    return sha256_file(f)


# ------------------------------------------------------------------ memory hints
def _factored_numel(shape: torch.Size) -> int:
    """Elements of Adafactor's second moment for a parameter of ``shape``: a row and a column vector over the last
    two dimensions of a matrix (or convolution), the whole tensor otherwise."""
    if len(shape) < 2:
        return math.prod(shape)
    return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]


@dataclass(frozen=True)
class _Layer:
    """A Linear or Conv2d of a part, as the planner counts it."""

    name: str
    linear: bool
    weight: int  # elements of its weight
    lora_in: int  # a LoRA's down-projection input size: in_features, or in_channels / groups * kh * kw
    lora_out: int  # its up-projection output size: out_features or out_channels


@dataclass(frozen=True)
class _PartFacts:
    """What the planner reads of one part built from one config: its Linear and Conv2d layers, parameter counts and
    the sizes of the family's swap blocks."""

    layers: tuple[_Layer, ...]
    total: int
    largest: int
    adafactor_state: int
    swap_units: tuple[int, ...]


#: _part_facts' cache: (family class, builder, part, config JSON) -> facts
_FACTS: dict[tuple[Any, Any, str, str], _PartFacts] = {}


def _part_facts(family, new_module: Callable[[str, dict], torch.nn.Module], part: str, config: str) -> _PartFacts:
    """The part built once on the meta device and read (``config``: its JSON, sorted). Cached per process, by the
    family's class, its builder, the part and the config: ``plan --vram`` estimates dozens of configs of the same
    model, and building the SDXL UNet 30 times, even on the meta device, took half of its 17 s."""
    key = (type(family), new_module, part, config)
    if key not in _FACTS:
        if len(_FACTS) >= 32:
            _FACTS.clear()
        _FACTS[key] = _read_part(family, new_module, part, config)
    return _FACTS[key]


def _read_part(family, new_module: Callable[[str, dict], torch.nn.Module], part: str, config: str) -> _PartFacts:
    with torch.device("meta"):
        module = new_module(part, json.loads(config))
    layers = []
    for name, m in module.named_modules():
        if type(m) is torch.nn.Linear:
            layers.append(_Layer(name, True, m.weight.numel(), m.in_features, m.out_features))
        elif type(m) is torch.nn.Conv2d:
            kh, kw = m.kernel_size
            layers.append(_Layer(name, False, m.weight.numel(), m.in_channels // m.groups * kh * kw, m.out_channels))
    params = list(module.parameters())
    swap = ()
    if part == family.denoiser:
        swap = tuple(sum(p.numel() for p in u.parameters()) for u in family.swap_blocks(module))
    return _PartFacts(
        tuple(layers),
        sum(p.numel() for p in params),
        max([0] + [p.numel() for p in params]),
        sum(_factored_numel(p.shape) for p in params),
        swap,
    )


def parameter_hints(
    family,
    new_module: Callable[[str, dict], torch.nn.Module],
    config_file: Callable[[str], Path],
    parts: Sequence[str],
    loaded: Sequence[str],
    trained: Sequence[str],
    method: str,
    lora_targets: Sequence[str],
    lora_rank: int,
) -> dict:
    """Parameter counts of each loaded part, built on the meta device from ``config_file(part)``.

    Per part: the total, what fp8 may store (Linear and Conv2d weights outside
    ``family.high_precision_modules``) and its Linear share; the LoRA parameters
    of the trained parts' targets (``lora_targets`` on the denoiser,
    ``family.text_encoder_lora_targets`` on text encoders); the largest
    parameter; and the sizes of the denoiser's ``swap_blocks``.
    """
    counts, lora, largest, swap_units = {}, 0, 0, []
    for part in parts:
        if part not in loaded:
            continue
        facts = _part_facts(family, new_module, part, json.dumps(read_json(config_file(part)), sort_keys=True))
        keep = family.high_precision_modules.get(part, ())
        targets = lora_targets if part == family.denoiser else family.text_encoder_lora_targets
        adapted = method == "lora" and part in trained
        eligible = linear = 0
        for layer in facts.layers:
            if not any(fnmatch.fnmatch(layer.name, k) for k in keep):
                eligible += layer.weight
                linear += layer.weight if layer.linear else 0
            if adapted and any(layer.name == tg or layer.name.endswith("." + tg) for tg in targets):
                lora += lora_rank * (layer.lora_in + layer.lora_out)
        largest = max(largest, facts.largest)
        counts[part] = {
            "total": facts.total,
            "fp8_eligible": eligible,
            "linear": linear,
            "adafactor_state": facts.adafactor_state,
        }
        if part == family.denoiser:
            swap_units = list(facts.swap_units)
    return {
        "parts": counts,
        "denoiser": family.denoiser,
        "swap_units": swap_units,
        "trained_parts": list(trained),
        "lora_params": lora,
        "largest_param": largest,
    }


def measured_hints(data_file: Path) -> dict:
    """The activation data measured for an architecture (its bundled memory.json; zeros without one)."""
    data = read_json(data_file) if data_file.exists() else {}
    return {
        "activations": data.get("activations_bytes_per_latent_pixel", {}),
        "text_encoder_activations": data.get("text_encoder_activation_bytes_per_sample", 0),
        "workspace": data.get("workspace_bytes", 0),
        "fused_backward_extra": data.get("fused_backward_extra_bytes", 0),
        "allocator_slack": data.get("allocator_slack_gib", 0.0),
        "write_back_slack": data.get("write_back_slack_gib", 0.0),
        "cuda_graph_pool": data.get("cuda_graph_pool_gib", 0.0),
    }


def _vae_config(folder: Path) -> dict:
    """``folder``'s vae/config.json, or nothing where it has none."""
    f = folder / "vae" / "config.json"
    return read_json(f) if f.is_file() else {}


def spatial_factor(vae_config: Mapping[str, Any]) -> int:
    """How many pixels a VAE's latent pixel spans per side: its config's scale_factor_spatial (Wan 2.2's and Qwen-Image
    2.1's VAEs, 16), else 8 (the VAEs whose configs do not state it: SDXL's, SD3's, Flux's, Wan 2.1's, Qwen-Image's)."""
    return int(vae_config.get("scale_factor_spatial") or 8)


def image_memory_hints(
    family,
    new_module: Callable[[str, dict], torch.nn.Module],
    base: Path,
    bundled: Path,
    parts: Sequence[str],
    loaded: Sequence[str],
    trained: Sequence[str],
    method: str,
    lora_targets: Sequence[str],
    lora_rank: int,
    resolution: int,
) -> dict:
    """An image family's numbers for the memory planner: the parameter counts of ``parts`` from ``base``'s configs
    (the model's diffusers folder, else the bundled architecture), the largest bucket's latent area (at the VAE's
    spatial_factor), and the activation data measured for the bundled architecture
    (``bundled``/memory.json), which is per latent pixel, so the planner's arithmetic is the same for every family."""
    return {
        **parameter_hints(
            family,
            new_module,
            lambda part: base / part / "config.json",
            parts,
            loaded,
            trained,
            method,
            lora_targets,
            lora_rank,
        ),
        # a folder without its VAE (bench's random ones hold only what training loads) has the bundled architecture's:
        # without this, Qwen-Image 2.1's 16x VAE was planned as 8x, four times its activations (+8.7 GiB on 2026-11-28)
        "latent_pixels": (resolution // spatial_factor(_vae_config(base) or _vae_config(bundled))) ** 2,
        **measured_hints(bundled / "memory.json"),
        "encode_captions": any(p.startswith("text_encoder") for p in trained),
    }


def vae_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """pixels in [-1, 1] -> the VAE's posterior mean (deterministic, so a cache entry depends on its inputs only),
    shifted by the VAE's shift_factor where it has one (SD3, Flux) and scaled by its scaling_factor, as float32."""
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
    shift = vae.config.get("shift_factor") or 0.0
    if shift:
        latents = latents - shift
    return (latents * vae.config.scaling_factor).float()


def t5_stage_tag(stage: str, options) -> str:
    """What besides weights decides a T5 stage's output (its precision and length; "t5:off" when disabled): part of
    its cache key. The CLIP stages have none."""
    if stage == "t5":
        return f"t5:{options.t5.precision}:{options.t5.max_length}" if options.t5.enabled else "t5:off"
    return ""


class LazyTensors(Mapping):
    """A read-only mapping whose values are computed when read (a fused qkv is concatenated on demand).

    ``stream_save_safetensors`` reads each value twice (header, then data) and
    keeps none, so at most one computed tensor exists at a time: saving a model
    on the GPU never holds a second full copy of it.
    """

    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]]):
        self._makers = makers

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._makers[key]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)
