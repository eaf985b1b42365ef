"""memory.activations.save_attention: checkpointed blocks keep their long attentions' outputs, so backward recomputes
the rest of the block but not those attentions; the gradients are those of plain checkpointing."""

import pytest
import torch

from conftest import AttentionBlock as Block
from conftest import count_attention
from difftrain.memory import checkpoint_policy
from difftrain.memory.checkpoint_policy import attention_ops, checkpoint_function


def _step(block, how, tokens=1024, context=16):
    torch.manual_seed(0)
    x = torch.randn(1, tokens, 16, requires_grad=True)
    ctx = torch.randn(1, context, 16)
    block.zero_grad(set_to_none=True)
    with count_attention() as counted:
        y = block(x, ctx) if how is None else checkpoint_function(how)(block, x, ctx)
        y.square().mean().backward()
    return counted.keys, [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


def test_the_long_attention_is_not_recomputed_and_the_gradients_are_checkpointings():
    torch.manual_seed(1)
    block = Block()
    plain_keys, plain = _step(block, None)
    ckpt_keys, ckpt = _step(block, False)
    kept_keys, kept = _step(block, True)
    # forward: the self-attention over 1024 keys and the cross-attention over 16; checkpointing runs both again in
    # backward, save_attention only the short one
    assert sorted(plain_keys) == [16, 1024]
    assert sorted(ckpt_keys) == [16, 16, 1024, 1024]
    assert sorted(kept_keys) == [16, 16, 1024]
    for a, b, c in zip(plain, ckpt, kept):
        assert torch.allclose(a, b, atol=1e-6) and torch.equal(b, c)


def test_attentions_over_few_keys_are_recomputed(monkeypatch):
    """Below MIN_KEYS an attention costs little to recompute against its output's bytes (Wan's 512 caption
    tokens): kept only from MIN_KEYS keys up."""
    block = Block()
    monkeypatch.setattr(checkpoint_policy, "MIN_KEYS", 2048)
    keys, _ = _step(block, True)
    assert sorted(keys) == [16, 16, 1024, 1024]
    monkeypatch.setattr(checkpoint_policy, "MIN_KEYS", 16)
    keys, _ = _step(block, True)
    assert sorted(keys) == [16, 1024]


def test_inside_a_compiled_block_too():
    """speed.compile checkpoints inside the compiled blocks (regional_compile.checkpoint_inside): torch.compile
    traces the selective checkpoint; the gradients are plain checkpointing's."""
    from difftrain.speed.regional_compile import checkpoint_inside

    torch.manual_seed(2)
    ref = Block()
    _, want = _step(ref, False)
    holder = torch.nn.Module()
    holder.block = Block()
    holder.block.load_state_dict(ref.state_dict())
    checkpoint_inside(holder, [holder.block], checkpoint_function(True))
    holder.block.compile(backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    x = torch.randn(1, 1024, 16, requires_grad=True)
    ctx = torch.randn(1, 16, 16)
    holder.block(x, ctx).square().mean().backward()
    got = [p.grad for p in holder.block.parameters()] + [x.grad]
    for a, b in zip(want, got):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_config_refuses_save_attention_beside_offloaded_or_split_checkpoints():
    from difftrain.config.load import resolve
    from difftrain.errors import ConfigError

    with pytest.raises(ConfigError, match="save_attention"):
        resolve("wan-1.3b-lora-8gb", None, ["memory.activations.save_attention=true"])  # offload and split on
    ok = [
        "memory.activations.offload=false",
        "memory.activations.split=false",
        "memory.activations.save_attention=true",
    ]
    assert resolve("wan-1.3b-lora-8gb", None, ok).config.memory.activations.save_attention is True


def test_the_planner_counts_what_save_attention_keeps_where_the_family_states_it():
    """Wan states its self-attentions' output bytes: one bf16 token of the width and an fp32 log-sum-exp per head
    for every 2x2 latent pixels, every block; a family that states none is marked as not counted."""
    from difftrain.config.load import resolve
    from difftrain.planning.estimate import plan_memory

    base = ["memory.activations.offload=false", "memory.activations.split=false", "data.resolution=480"]
    without = plan_memory(resolve("wan-1.3b-lora-8gb", None, base).config)
    cfg = resolve("wan-1.3b-lora-8gb", None, [*base, "memory.activations.save_attention=true"]).config
    kept = plan_memory(cfg)
    latent = 21 * 60 * 60  # 81 frames -> 21 latent frames, 480 px -> 60 latent pixels a side
    want = 30 * (1536 * 2 + 12 * 4) / 4 * latent / 2**30  # Wan 1.3B: 30 blocks of 12 heads x 128
    assert kept.gpu["activations"] - without.gpu["activations"] == pytest.approx(want, rel=1e-6)
    assert not kept.unknown_activations
    z = resolve("zimage-lora-12gb", None, ["memory.activations.save_attention=true"]).config
    assert plan_memory(z).unknown_activations


def test_the_op_table_is_read_again_for_each_checkpointed_block(monkeypatch):
    """FA4's forward (speed.attention: fa4) registers when the speed section takes it, which may come after a first
    checkpointed call: a table read before it (here: one read while no op was known) is not kept."""
    import difftrain.speed.fa4  # noqa: F401 - registers difftrain::fa4_forward (its kernels load only when called)

    monkeypatch.setattr(checkpoint_policy, "_ATEN", ())
    monkeypatch.setattr(torch.ops, "difftrain", None)
    checkpoint_policy.attention_ops.cache_clear()
    assert attention_ops() == {}  # the stale table
    monkeypatch.undo()
    checkpoint_policy.save_attention_context()  # a checkpointed block starts
    ops = attention_ops()
    assert ops[torch.ops.difftrain.fa4_forward.default] == 1  # FA4 takes [batch, keys, heads, dim]
    assert ops[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default] == -2
    q = torch.empty(1, 1024, 2, 8)
    assert checkpoint_policy.keeps(torch.ops.difftrain.fa4_forward.default, (q, q, q, 1.0))
