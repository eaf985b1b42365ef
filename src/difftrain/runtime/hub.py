"""Hugging Face Hub model ids wherever a model path goes: ``org/name``, ``org/name@revision`` and a single file in a
repo, ``org/name/sd_xl_base_1.0.safetensors[@revision]``.

Resolved through huggingface_hub (the library every diffusers user's cache comes from, so a model downloaded by
diffusers before is found here too): from the local cache when offline (HF_HUB_OFFLINE=1, or no network), else
downloaded with huggingface_hub's progress bars. Of a diffusers repo only what the family loads is fetched: the
folders of its parts and the tokenizers, in safetensors, without the fp16 / non-EMA variants and the ONNX,
Flax and pickle copies many repos also hold (SDXL base: ~7 GB instead of ~70). A local path that exists always
wins over an id of the same spelling.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?P<file>/[^@]+)?(?:@(?P<rev>[\w./-]+))?$")
#: copies a diffusers repo may hold that difftrain never reads
IGNORE = ["*.bin", "*.ckpt", "*.pt", "*.pth", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.pb", "*.mlmodel*"]
#: variant weights diffusers picks only when asked (``variant="fp16"``): the plain file is the one loaded
VARIANTS = ["*.fp16.safetensors", "*.non_ema.safetensors", "*.ema.safetensors", "*fp16*/**"]


@dataclass(frozen=True)
class HubRef:
    repo: str
    file: str | None  # a single file inside the repo
    revision: str | None

    def __str__(self) -> str:
        return self.repo + (f"/{self.file}" if self.file else "") + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(value: str | Path) -> HubRef | None:
    """A Hub reference, or None for what must be a local path (it exists, is absolute or relative with ./, ~, or
    has a backslash or drive letter)."""
    text = str(value)
    if not text or Path(text).expanduser().exists() or text.startswith((".", "/", "~")) or "\\" in text:
        return None
    if re.match(r"^[A-Za-z]:", text):
        return None
    m = _ID.match(text)
    if m is None:
        return None
    file = m.group("file")
    return HubRef(m.group("repo"), file[1:] if file else None, m.group("rev"))


def fetch(ref: HubRef, parts: Sequence[str]) -> Path:
    """The local path of ``ref``: a single file, or a snapshot folder holding ``parts`` (and the tokenizers,
    scheduler and model_index.json) of a diffusers repo."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub import errors as hub_errors

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        if ref.file:
            return Path(
                hf_hub_download(ref.repo, ref.file, revision=ref.revision, local_files_only=offline)
            )  # nothing else of the repo
        allow = ["model_index.json", *(f"{p}/*" for p in parts), "tokenizer*/*", "scheduler/*"]
        folder = Path(
            snapshot_download(
                ref.repo,
                revision=ref.revision,
                allow_patterns=allow,
                ignore_patterns=IGNORE + VARIANTS,
                local_files_only=offline,
            )
        )
        if not any(folder.glob("*/*.safetensors")):  # a repo that holds only variants: take the fp16 ones
            folder = Path(
                snapshot_download(
                    ref.repo,
                    revision=ref.revision,
                    allow_patterns=allow,
                    ignore_patterns=IGNORE,
                    local_files_only=offline,
                )
            )
        return folder
    except hub_errors.GatedRepoError:
        raise ModelLoadError(
            f"{ref.repo} is a gated model: its licence must be accepted before it can be downloaded.",
            hint=f"Accept it on https://huggingface.co/{ref.repo} while logged in, then log in here with "
            "`hf auth login` (or set HF_TOKEN), and run the command again.",
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise ModelLoadError(
            f"No model {ref.repo} on the Hugging Face Hub (or it is private).",
            hint="Check the id (org/name), log in with `hf auth login` for a private one, or give a local path.",
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise ModelLoadError(
            f"{ref.repo} has no revision {ref.revision!r}.", hint="Give a branch, tag or commit of the repo after @."
        ) from None
    except hub_errors.LocalEntryNotFoundError:  # first: a subclass of EntryNotFoundError
        raise ModelLoadError(
            f"{ref} is not in the local Hugging Face cache"
            + (" and HF_HUB_OFFLINE is set" if offline else ", and the Hub could not be reached")
            + ".",
            hint=f"Download it where there is a network (`hf download {ref.repo}`), or unset HF_HUB_OFFLINE, or give "
            "a local path.",
        ) from None
    except hub_errors.EntryNotFoundError:
        raise ModelLoadError(
            f"{ref.repo} has no file {ref.file!r}.", hint="Check the file's name on the model page, or give org/name."
        ) from None


def resolve_model_path(value: str | Path | None, parts: Sequence[str]) -> tuple[Path | None, HubRef | None]:
    """``value`` as a local path: a Hub id fetched (or found in the cache), anything else unchanged."""
    if value is None:
        return None, None
    ref = parse_hub_id(value)
    if ref is None:
        return Path(value), None
    return fetch(ref, parts), ref
