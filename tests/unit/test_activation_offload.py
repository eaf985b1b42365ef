"""memory.activations.offload: checkpointed blocks whose inputs wait in host RAM compute what plain
checkpointing computes (outputs, every gradient), for blocks of any call shape; the planner moves the checkpoints'
bytes from the GPU to the host; a tiny Wan trains with it as without it."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.memory.activation_offload import offloaded_checkpoint


class _Pair(torch.nn.Module):
    """A block called with a tensor, a tuple of tensors and a float, returning a tuple (Flux's double blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, rope, scale):
        return self.a(x * rope[0]) * scale, self.b(x + rope[1])


def test_a_tuple_returning_block_gets_the_gradients_of_the_plain_call():
    torch.manual_seed(0)
    block = _Pair()
    block.a.weight.requires_grad_(False)  # frozen, as a LoRA's base weights
    x = torch.randn(4, 8)  # needs no grad: only the block's parameters train
    rope = (torch.randn(4, 8), torch.randn(4, 8))
    grads = []
    for call in (lambda: block(x, rope, 0.5), lambda: offloaded_checkpoint(block, x, rope, 0.5)):
        block.zero_grad()
        u, v = call()
        (u.square().sum() + v.sum()).backward()
        grads.append([p.grad.clone() for p in block.parameters() if p.requires_grad])
    assert len(grads[1]) == 3 and all(torch.equal(a, b) for a, b in zip(*grads))
    with torch.no_grad():  # no autograd: a plain call
        assert torch.equal(offloaded_checkpoint(block, x, rope, 0.5)[0], block(x, rope, 0.5)[0])


def test_a_wan_transformer_with_offloaded_checkpoints_gets_the_lora_gradients_of_plain_checkpointing(tmp_path):
    from peft import LoraConfig

    from difftrain.config.schema import ModelConfig
    from difftrain.families.wan import Wan

    fam = Wan()
    base = fam.load(ModelConfig(path=fam.build_tiny(tmp_path / "m")), ["transformer"])["transformer"]
    results = []
    for func, split in ((None, False), (offloaded_checkpoint, False), (offloaded_checkpoint, True), (None, True)):
        m = copy.deepcopy(base)
        if split:
            assert fam.split_blocks(list(m.blocks)) == 2
        torch.manual_seed(0)
        m.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "ffn.net.2"], init_lora_weights="gaussian"))
        m.enable_gradient_checkpointing(func)
        m.train()
        g = torch.Generator().manual_seed(1)
        x, text = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 512, 32, generator=g)
        out = m(hidden_states=x, timestep=torch.tensor([300.0, 700.0]), encoder_hidden_states=text, return_dict=False)[
            0
        ]
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (o1, g1) = results[0]
    assert len(g1) == 12  # to_q of both attentions, ffn.net.2
    for o2, g2 in results[1:]:
        assert torch.equal(o1, o2) and set(g1) == set(g2)
        assert all(torch.equal(g1[k], g2[k]) for k in g1)


def test_keep_on_gpu_leaves_the_last_blocks_inputs_in_place_with_the_same_gradients(tmp_path, monkeypatch):
    """memory.activations.keep_on_gpu: the last n blocks' inputs are not copied to host RAM; the gradients are those
    of offloading every block (and of none offloaded)."""
    from peft import LoraConfig

    from difftrain.config.schema import ModelConfig
    from difftrain.families.wan import Wan
    from difftrain.memory import activation_offload as ao

    fam = Wan()
    base = fam.load(ModelConfig(path=fam.build_tiny(tmp_path / "m")), ["transformer"])["transformer"]
    monkeypatch.setattr(ao, "MIN_OFFLOAD_BYTES", 0)  # the tiny model's inputs are all small
    stored: list[int] = []
    to_host = ao._to_host
    monkeypatch.setattr(ao, "_to_host", lambda t: stored.append(t.numel()) or to_host(t))
    results = []
    for keep in (0, 1, 2):
        m = copy.deepcopy(base)
        torch.manual_seed(0)
        m.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "ffn.net.2"], init_lora_weights="gaussian"))
        ao.keep_on_gpu(list(m.blocks), keep)
        m.enable_gradient_checkpointing(offloaded_checkpoint)
        m.train()
        g = torch.Generator().manual_seed(1)
        x, text = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 512, 32, generator=g)
        stored.clear()
        out = m(hidden_states=x, timestep=torch.tensor([300.0, 700.0]), encoder_hidden_states=text, return_dict=False)[
            0
        ]
        out.square().mean().backward()
        results.append((len(stored), out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    ao.keep_on_gpu([], 0)
    per_block = results[0][0] // 2
    assert per_block > 0 and [r[0] for r in results] == [2 * per_block, per_block, 0]  # 2 blocks, the last kept first
    for _, o, grads in results[1:]:
        assert torch.equal(o, results[0][1]) and grads.keys() == results[0][2].keys()
        assert all(torch.equal(grads[k], results[0][2][k]) for k in grads)


def test_segments_leave_a_recomputed_wan_block_only_their_inputs_saved():
    """What a block saves for backward outside its checkpoints (beyond its weights), counted by torch's saved-tensor
    hooks: whole (the 1.3B's widths, LoRA r32 on every Linear), some 32 block inputs' worth; as memory.activations.split
    runs it, only the segments' inputs (the block input, the two attentions' outputs and the text: four inputs' worth),
    the rest recomputed in backward one segment at a time."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from difftrain.families.common import configs_root, read_json
    from difftrain.families.wan import Wan

    cfg = read_json(configs_root() / "wan2.1-t2v-1.3b" / "transformer" / "config.json")
    m = WanTransformer3DModel.from_config({**cfg, "num_layers": 1}).to(torch.bfloat16).requires_grad_(False)
    m.add_adapter(LoraConfig(r=32, lora_alpha=32, target_modules=list(Wan.default_lora_targets)))
    tokens, d = 21 * 4 * 6, 1536
    args = (torch.randn(1, tokens, d, dtype=torch.bfloat16), torch.randn(1, 512, d, dtype=torch.bfloat16),
            torch.randn(1, 6, d, dtype=torch.bfloat16), m.rope(torch.zeros(1, 16, 21, 8, 12)))  # fmt: skip
    weights = {p.data_ptr() for p in m.parameters()}

    def saved() -> float:
        seen: dict[int, int] = {}

        def pack(t):
            if t.data_ptr() not in weights:
                seen.setdefault(t.data_ptr(), t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m.blocks[0](*args)
        return sum(seen.values()) / (tokens * d * 2)

    whole = saved()
    assert Wan().split_blocks(list(m.blocks)) == 1
    segments = saved()
    assert whole > 25 and 3.9 < segments < 4.1, (whole, segments)


def test_the_planner_moves_the_checkpoints_to_host_ram(tmp_path):
    from difftrain.families.wan import Wan
    from difftrain.memory.planner import estimate

    sets = ["memory.activations={kind: checkpoint, offload: true}", "model.config=wan2.1-t2v-1.3b", "data.frames=81"]
    cfg = resolve(recipe="tiny-wan-lora", sets=[*sets, f"data.dir={tmp_path}"]).config
    plain = cfg.model_copy(
        update={
            "memory": cfg.memory.model_copy(
                update={"activations": cfg.memory.activations.model_copy(update={"offload": False})}
            )
        }
    )
    fam = Wan()
    hints = fam.memory_hints(
        cfg.model, cfg.lora.targets, cfg.lora.rank, 640, ["transformer"], ["transformer"], "lora", frames=81
    )
    hints["activations"] = {"checkpoint": 40000.0}  # bytes per latent pixel, more than the inputs alone (23 040)
    on, off = estimate(cfg, hints), estimate(plain, hints)
    # 30 blocks x 1536 x 2 bytes per token, a token per 4 latent pixels; 21 x 80 x 80 latent pixels at 640 px, 81 frames
    moved = 30 * 1536 * 2 / 4 * 21 * 80 * 80 / 2**30
    assert on.host["checkpoints (offloaded, pinned)"] == pytest.approx(moved)
    assert off.gpu["activations"] - on.gpu["activations"] == pytest.approx(moved)
    hints["activations"] = {}  # no activation data for the architecture: the host still holds the checkpoints
    bare = estimate(cfg, hints)
    assert bare.gpu["activations"] == 0 and bare.host["checkpoints (offloaded, pinned)"] == pytest.approx(moved)
    # keep_on_gpu: 10 of the 30 blocks' inputs stay on the GPU, the other 20 go to host RAM
    hints["activations"] = {"checkpoint": 40000.0}
    acts = cfg.memory.activations.model_copy(update={"keep_on_gpu": 10})
    kept = estimate(cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"activations": acts})}), hints)
    assert kept.host["checkpoints (offloaded, pinned)"] == pytest.approx(moved * 20 / 30)
    assert off.gpu["activations"] - kept.gpu["activations"] == pytest.approx(moved * 20 / 30)


@pytest.mark.slow
def test_tiny_wan_trains_alike_with_offloaded_and_split_checkpoints(_dataset_master, tmp_path, monkeypatch):
    """... and the trainer gives the offloaded checkpoints' host slab back before its final save (the save's host
    copies came on top of the slab and made Wan 14B's host peak at 720p, 2026-11-27)."""
    from difftrain.families.wan import Wan
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import Trainer, train

    model = Wan().build_tiny(tmp_path / "m")
    from difftrain.memory import activation_offload as ao

    events: list[str] = []
    reset, save = ao.reset_arena, Trainer.save_checkpoint
    monkeypatch.setattr(ao, "reset_arena", lambda: (events.append("arena given back"), reset())[1])
    monkeypatch.setattr(Trainer, "save_checkpoint", lambda self: (events.append("saved"), save(self))[1])
    losses = []
    acts = ("{kind: none}", "{kind: checkpoint, offload: true, split: true}",
            "{kind: checkpoint, offload: true, split: true, keep_on_gpu: 1}")  # fmt: skip
    for i, act in enumerate(acts):
        sets = tiny_sets(model, _dataset_master, tmp_path / str(i), **{"train.max_steps": 3, "memory.activations": act})
        cfg = resolve(recipe="tiny-wan-lora", sets=sets).config
        precompute(cfg)
        losses.append(train(cfg).losses)
        assert len(ao._KEPT) == (1 if "keep_on_gpu" in act else 0)  # the trainer named the family's last block
        assert events[-2:] == ["arena given back", "saved"]  # the final save, after the slab went back
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)
    assert losses[2] == losses[1]


class _Pins:
    """A stand-in for pinned slabs on the CPU: counts what was made and given back."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self.freed = 0

    def __call__(self, nbytes):
        self.made.append(nbytes)

        def free():
            self.freed += 1

        return torch.empty(nbytes, dtype=torch.uint8), free


def test_the_host_arena_copies_exactly_shares_repeated_tensors_and_regroups_into_one_slab():
    from difftrain.memory.activation_offload import ALIGN, HostArena

    pins = _Pins()
    a = HostArena(pin=pins)
    g = torch.Generator().manual_seed(0)
    big = [torch.randn(1000, 33, generator=g).to(torch.bfloat16) for _ in range(3)]  # 66 000 bytes each
    table = torch.randn(64, 17, generator=g)  # given to every block, as Wan's rotary tables
    held = []
    for x in big:
        held += [a.store(x), a.store(table)]
    assert all(torch.equal(h, x) for h, x in zip(held[::2], big)) and torch.equal(held[1], table)
    assert held[1] is held[3] is held[5]  # one copy of the shared table
    rounded = lambda n: -(-n // ALIGN) * ALIGN
    first = [rounded(66_000), rounded(64 * 17 * 4), rounded(66_000), rounded(66_000)]
    assert pins.made == first and a.live == 4  # a slab of each copy's exact size, the first round
    del held
    assert a.live == 0 and a.high == sum(first)  # every copy released: a new round
    table.add_(1.0)  # changed in place: copied again, not the old copy reused
    again = [a.store(big[0]), a.store(table), a.store(big[1]), a.store(table), a.store(big[2])]
    assert pins.freed == 4 and pins.made[4:] == [sum(first)]  # the four slabs gave way to one of the round's size
    assert torch.equal(again[1], table) and a.held_bytes == sum(first)
    assert all((h.data_ptr() - again[0].data_ptr()) % ALIGN == 0 for h in again)  # aligned views of one slab
    del again
    larger = torch.zeros(3000, 33, dtype=torch.bfloat16)  # a bucket that needs more: exact slabs, then one of all
    more = [a.store(larger), a.store(big[0]), a.store(big[1])]
    assert pins.made[5:] == [rounded(66_000)] * 2 and a.regroup
    del more
    kept = a.store(larger)
    assert pins.made[-1] == rounded(198_000) + 2 * rounded(66_000) and a.held_bytes == pins.made[-1]
    assert torch.equal(kept, larger)


def test_a_slab_is_ordinary_memory_registered_with_the_driver_and_unregistered_when_given_back(monkeypatch):
    """On Linux the arena's slabs are exactly their size: memory of the CPU allocator, registered (page-locked) with
    cudaHostRegister and unregistered when the arena lets the slab go (the driver's calls faked here)."""
    import sys

    from difftrain.memory import activation_offload as ao

    if sys.platform != "linux":
        pytest.skip("the registered slabs are Linux's")
    calls = []

    class _Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart())
    import mmap

    buf, free = ao._pin_exact(3 * 1000 + 7)
    assert buf.numel() == 3007 and not buf.is_pinned() and calls == [("register", buf.data_ptr(), 3007)]
    other, free_other = ao._pin_exact(10)
    # pages of its own: two slabs never share a page (the driver refuses a range overlapping a registered one)
    assert buf.data_ptr() % mmap.PAGESIZE == 0 and other.data_ptr() % mmap.PAGESIZE == 0
    assert abs(other.data_ptr() - buf.data_ptr()) >= mmap.PAGESIZE
    buf[:] = 7  # ordinary writable memory
    assert int(buf.sum()) == 7 * 3007
    free()
    assert calls[-1] == ("unregister", buf.data_ptr())
    free_other()


def test_an_arena_given_up_unregisters_every_slab_once():
    """A replaced or dropped arena gives its slabs back (a registration left on freed memory made the next one of
    those addresses fail on the GPU: "resource already mapped"); copies still held stay readable."""
    from difftrain.memory import activation_offload as ao

    pins = _Pins()
    a = ao.HostArena(pin=pins)
    x = torch.randn(1000, 40)
    kept = [a.store(x), a.store(x + 1)]
    assert len(pins.made) == 2 and pins.freed == 0
    a.close()
    assert pins.freed == 2 and a.held_bytes == 0 and torch.equal(kept[0], x)
    a.close()
    assert pins.freed == 2  # once each
    b = ao.HostArena(pin=_Pins())
    b.store(x)
    freed = b.pin
    del b
    assert freed.freed == 1  # dropped: unregistered on the way out
    ao._ARENA = ao.HostArena(pin=pins)
    ao._ARENA.store(x)
    ao.reset_arena()
    assert pins.freed == 3 and ao._ARENA is None


@pytest.fixture
def _budget():
    from difftrain.memory import pinned

    yield pinned
    pinned.configure(None)  # the next test starts from the default (no cap)


def test_the_arena_slabs_count_against_pinned_limit_gib_and_give_their_bytes_back(_budget, capsys, monkeypatch):
    """memory.pinned_limit_gib caps the arena's slabs together with block swap's: a slab past it is pageable (said
    once), and a slab freed (regrouped, closed) gives its bytes back, so a later one pins again."""
    from difftrain.memory.activation_offload import ALIGN, HostArena

    pinned = _budget
    monkeypatch.setattr(pinned, "SLAB", 64 * 1024)  # block swap's slabs, small enough to show the shared cap
    swap_pins: list[int] = []
    pinned.configure(100_000 / 2**30, pin=lambda n: swap_pins.append(n) or torch.empty(n, dtype=torch.uint8))
    b = pinned.budget()
    slab = -(-66_000 // ALIGN) * ALIGN
    x, y = torch.randn(1000, 33).to(torch.bfloat16), torch.randn(1000, 33).to(torch.bfloat16)  # 66 000 bytes each
    pins = _Pins()
    a = HostArena(pin=pins)
    held = [a.store(x), a.store(y), a.store(x + 1)]  # room for one slab, not two
    assert pins.made == [slab] and b.taken_bytes == slab and len(a.slabs) == 3
    assert torch.equal(held[0], x) and torch.equal(held[1], y) and torch.equal(held[2], x + 1)  # pageable, correct
    assert capsys.readouterr().err.count("pinned_limit_gib") == 1 and len(b.warnings) == 1  # said once
    del held
    again = a.store(x)  # regrouped: the pinned slab given back; the round's one slab (3 copies) is past the cap
    assert pins.freed == 1 and pins.made == [slab] and b.taken_bytes == 0 and torch.equal(again, x)
    a.close()
    assert b.taken_bytes == 0 and pins.freed == 1  # a pageable slab gives back nothing
    c = HostArena(pin=pins)
    kept = c.store(y)  # room again: pinned
    assert pins.made == [slab, slab] and b.taken_bytes == slab and torch.equal(kept, y)
    # block swap's host copies share the cap: its 64 KiB slab does not fit beside the arena's ...
    assert not swap_pins and pinned.host_like(torch.randn(10_000), pinned=True).numel() == 10_000
    assert swap_pins == [] and b.pageable_bytes == 40_000
    c.close()
    assert pins.freed == 2 and b.taken_bytes == 0
    pinned.host_like(torch.randn(10_000), pinned=True)  # ... and does once the arena gave its slab back
    assert swap_pins == [64 * 1024] and b.pinned_bytes == 64 * 1024
    assert "pinned_limit_gib" not in capsys.readouterr().err  # no second warning


def test_without_a_pinned_limit_every_arena_slab_is_pinned(_budget, capsys):
    from difftrain.memory.activation_offload import ALIGN, HostArena

    _budget.configure(None)
    b = _budget.budget()
    pins = _Pins()
    a = HostArena(pin=pins)
    held = [a.store(torch.randn(1000, 40)) for _ in range(5)]
    assert len(pins.made) == 5 and b.taken_bytes == 5 * -(-160_000 // ALIGN) * ALIGN
    assert b.warnings == [] and "pinned_limit_gib" not in capsys.readouterr().err
    a.close()
    assert pins.freed == 5 and b.taken_bytes == 0 and len(held) == 5
