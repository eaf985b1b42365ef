"""CogVideoX's positions at sizes it was not trained at: the latent frame count of a clip, and the learned
positional table of 1.0 models resampled where the model's 3D RoPE puts the patches of another grid (a
patch_embed pre-hook swaps it in for one call)."""

from __future__ import annotations

import torch


def latent_frames(frames: int) -> int:
    """Latent frames of a clip of ``frames`` pixel frames (4k + 1 -> k + 1; the VAE compresses time 4x)."""
    return (frames - 1) // 4 + 1


def _resize_crop_region(
    src: tuple[int, int], tgt_width: int, tgt_height: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The grid's crop box inside the base grid, as CogVideoX's pipelines place RoPE positions (1.0 models)."""
    h, w = src
    if h / w > tgt_height / tgt_width:
        rh, rw = tgt_height, round(tgt_height / h * w)
    else:
        rw, rh = tgt_width, round(tgt_width / w * h)
    top, left = round((tgt_height - rh) / 2.0), round((tgt_width - rw) / 2.0)
    return (top, left), (top + rh, left + rw)


def resample_positional_table(pe, frames: int, height: int, width: int) -> torch.Tensor:
    """``pe.pos_embedding`` (``[1, text + T*H*W, D]``, text rows zero) for ``frames`` latent frames of
    ``height`` x ``width`` latents, sampled where the model's 3D RoPE puts those patches.

    Time: patch ``t`` takes the table's frame ``t`` (RoPE's temporal positions are
    the integers 0, 1, ...; frames past the table's last repeat it). Space: the
    grid is fitted inside the table's grid with the crop box and linspace
    positions of CogVideoXPipeline's RoPE (``_resize_crop_region``), and rows and
    columns are interpolated linearly between table cells (clamped at the
    edges). At the native size every position is an integer and the result is
    the table itself. A ViT-style resize of a learned table, placed as RoPE
    places the patches, so both position signals agree.
    """
    p, text = pe.patch_size, pe.max_text_seq_length
    t0, h0, w0 = latent_frames(pe._difftrain_native[0]), pe._difftrain_native[1] // p, pe._difftrain_native[2] // p
    table = pe.pos_embedding
    grid = table[:, text:].reshape(t0, h0, w0, table.shape[-1]).float()
    gh, gw = height // p, width // p
    (top, left), (bottom, right) = _resize_crop_region((gh, gw), w0, h0)
    rows = torch.linspace(top, bottom * (gh - 1) / gh, gh, device=table.device, dtype=torch.float64)
    cols = torch.linspace(left, right * (gw - 1) / gw, gw, device=table.device, dtype=torch.float64)
    times = torch.arange(frames, device=table.device, dtype=torch.float64)
    for dim, pos in ((0, times), (1, rows), (2, cols)):
        grid = _lerp_along(grid, pos, dim)
    return torch.cat([table[:, :text], grid.reshape(1, -1, table.shape[-1]).to(table.dtype)], dim=1)


def _lerp_along(x: torch.Tensor, pos: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` sampled at fractional indices ``pos`` along ``dim``: linear between neighbours, clamped to the ends."""
    pos = pos.clamp(0, x.shape[dim] - 1)
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=x.shape[dim] - 1)
    shape = [1] * x.dim()
    shape[dim] = -1
    frac = (pos - lo).to(x.dtype).view(shape)
    a, b = x.index_select(dim, lo), x.index_select(dim, hi)
    return torch.where(frac == 0, a, a + (b - a) * frac)  # exact at integer positions


def _fit_table(pe, args) -> None:
    """patch_embed pre-hook: for a batch off the table's size, swap in the resampled table (and the sizes
    diffusers compares against) for this one call; ``_restore_table`` puts the stored one back."""
    _restore_table(pe, args, None)  # a previous call that raised left the resampled table in place
    _, frames, _, height, width = args[1].shape
    size = ((frames - 1) * pe.temporal_compression_ratio + 1, height, width)
    if size == pe._difftrain_native:
        return
    table = pe.pos_embedding
    pe.pos_embedding = resample_positional_table(pe, frames, height, width)
    pe._difftrain_table = table
    pe.sample_frames, pe.sample_height, pe.sample_width = size


def _restore_table(pe, args, output) -> None:
    if pe._difftrain_table is not None:
        pe.pos_embedding, pe._difftrain_table = pe._difftrain_table, None
        pe.sample_frames, pe.sample_height, pe.sample_width = pe._difftrain_native
