"""CLIP tokenizers built offline.

No model hub is reachable, and single-file SDXL/SD3 checkpoints carry no
tokenizer files. Two offline sources:

* ``tiny_clip_vocab`` writes a small byte-level BPE vocabulary (every byte
  symbol, alone and word-final, no merges): enough for tests and quickstart,
  where the tiny text encoders have a 1000-token embedding table.
* ``clip_vocab_from_open_clip`` derives CLIP's real 49408-token ``vocab.json``
  and ``merges.txt`` from the BPE file shipped in the ``open_clip_torch``
  wheel (the same derivation CLIP's own tokenizer does), without importing
  open_clip (it would pull torchvision).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import string
from pathlib import Path

from ..errors import ModelLoadError

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def _write(folder: Path, vocab: dict[str, int], merges: list[str], pad_token: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8")
    cfg = {
        "model_max_length": 77,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": EOS,
        "pad_token": pad_token,
        "do_lower_case": True,
        "tokenizer_class": "CLIPTokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return folder


def tiny_clip_vocab(folder: Path, pad_token: str = EOS) -> Path:
    """Write a 514-token byte-level CLIP vocabulary (ids < 1000) to ``folder``."""
    symbols = list(bytes_to_unicode().values())
    vocab_list = symbols + [s + "</w>" for s in symbols] + [BOS, EOS]
    return _write(folder, {tok: i for i, tok in enumerate(vocab_list)}, [], pad_token)


def clip_vocab_from_open_clip(folder: Path, pad_token: str = EOS) -> Path:
    """Write CLIP's real vocabulary, derived from open_clip's bundled BPE file."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "A single-file checkpoint carries no tokenizer, and none was given.",
            hint="Pass model.tokenizer_path=<folder with tokenizer/ and tokenizer_2/> "
            "or `pip install --no-deps open_clip_torch` so difftrain can build CLIP's tokenizer offline.",
        )
    bpe = Path(next(iter(spec.submodule_search_locations))) / "bpe_simple_vocab_16e6.txt.gz"
    with gzip.open(bpe, "rt", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]
    symbols = list(bytes_to_unicode().values())
    vocab_list = symbols + [s + "</w>" for s in symbols]
    vocab_list += ["".join(m.split()) for m in merges]
    vocab_list += [BOS, EOS]
    return _write(folder, {tok: i for i, tok in enumerate(vocab_list)}, merges, pad_token)


def tiny_t5_tokenizer(folder: Path) -> Path:
    """Write a tiny character-level T5 tokenizer (Unigram, ids < 140) to ``folder``, offline.

    Special ids as T5's: <pad> 0, </s> 1, <unk> 2; "$A </s>" appended like T5's
    post-processor; "▁"-prefixed words like SentencePiece. Enough for tests and
    quickstart, where the tiny T5 has a 300-token embedding table.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

    folder = Path(folder)
    chars = [c for c in string.printable if c not in string.whitespace]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("▁" + c, -2.5) for c in string.ascii_lowercase + string.digits]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    fast = T5TokenizerFast(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0, model_max_length=512
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


#: a chat template that renders as Qwen3's does for one user message with the generation prompt (and thinking
#: left on, as ZImagePipeline asks): "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
QWEN_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


#: Qwen2.5-VL's vision tokens, in the order of their ids (151652 ...; the tiny tokenizer's 259 ...)
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def tiny_qwen_tokenizer(folder: Path, vision: bool = False) -> Path:
    """Write a tiny byte-level Qwen2 tokenizer (the 256 byte symbols, no merges, Qwen's three chat tokens: ids <
    259) with a chat template rendering as Qwen3's, to ``folder``, offline. For tests and quickstart, where the
    tiny Qwen3 has a 300-token embedding table. ``vision``: Qwen2.5-VL's five vision tokens too (ids 259-263), what
    Qwen2VLProcessor marks an image's place with (Qwen-Image-Edit)."""
    from transformers import Qwen2Tokenizer

    folder = Path(folder)
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(QWEN_VISION_TOKENS if vision else ())]
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<|endoftext|>",
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=1024,
    )
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = QWEN_TINY_CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return folder
