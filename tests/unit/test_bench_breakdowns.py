"""bench speed's breakdowns: --profile sorts the profiled step's GPU time by what each kernel does (names as
Hopper's cuBLAS/cuDNN/flash/inductor kernels are called), so a missed MFU target says where the time went; a
compiled run reports where compiling went."""

from difftrain.flows.bench import compile_phases, kernel_breakdown, kernel_kind


def test_kernel_names_sort_into_kinds():
    cases = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "matmul",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "matmul",
        "triton_tem_fused_mm_3": "matmul",
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64": "convolution",
        "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": "convolution",
        "triton_tem_fused_convolution_1": "convolution",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(...)": "attention",
        "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)": "attention",
        "void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>(...)": "layout transposes",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)": "matmul",
        # inductor names a fused kernel after the aten ops it swallowed: still pointwise / reduction work
        "triton_poi_fused_add_convolution_backward_mm_0": "fused pointwise (inductor)",
        "triton_red_fused_native_group_norm_backward_7": "fused reductions, norms (inductor)",
        "triton_per_fused__scaled_dot_product_flash_attention_2": "fused reductions, norms (inductor)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        # bitsandbytes' 8-bit and 32-bit Adam (memory.optimizer adamw8bit: per-parameter kernels)
        "void kOptimizerStatic8bit2StateBlockwise<__nv_bfloat16, 0, 256, 1>(...)": "optimizer",
        "void kOptimizer32bit2State<__nv_bfloat16, 0>(__nv_bfloat16*, ...)": "optimizer",
        "Memcpy HtoD (Pinned -> Device)": "copies, memset",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "other (aten elementwise, reductions)",
    }
    got = {name: kernel_kind(name) for name in cases}
    assert got == cases


def test_breakdown_sums_time_and_counts_per_kind_largest_first():
    rows = [
        ("nvjet_tst_a", 3000.0, 10),
        ("triton_poi_fused_add_0", 500.0, 40),
        ("nvjet_tst_b", 1000.0, 5),
        ("fmha_cutlassF_bf16", 500.0, 2),
    ]
    got = kernel_breakdown(rows)
    assert next(iter(got)) == "matmul"  # the largest first (the other two tie)
    assert got["matmul"] == {"ms": 4.0, "share": 0.8, "kernels": 15}
    assert got["fused pointwise (inductor)"] == {"ms": 0.5, "share": 0.1, "kernels": 40}
    assert abs(sum(v["share"] for v in got.values()) - 1) < 1e-9
    assert kernel_breakdown([]) == {}


def test_compile_phases_come_from_torch_timers(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    import torch._dynamo

    torch._dynamo.reset()
    from difftrain.flows.bench import _compile_totals

    before = compile_phases()["graphs"]

    @torch.compile(backend="aot_eager")
    def f(x):
        return (x.sin() * 2).sum()

    f(torch.randn(8))
    got = compile_phases(top=3)
    assert got["graphs"] == before + 1
    assert len(got["phases_s"]) == 3 and "_compile.compile_inner" in got["phases_s"]
    values = list(got["phases_s"].values())
    assert values == sorted(values, reverse=True) and values[0] > 0
    # counted from a snapshot (a compiled baseline run before the config's): only what compiled after it
    mid = _compile_totals()
    f2 = torch.compile(lambda x: x.cos().sum(), backend="aot_eager")
    f2(torch.randn(4))
    second, total = compile_phases(since=mid), compile_phases()
    assert second["graphs"] == 1 and total["graphs"] == before + 2
    assert 0 < second["phases_s"]["_compile.compile_inner"] < total["phases_s"]["_compile.compile_inner"]


def test_the_flop_count_retries_with_checkpointing_after_freeing_what_the_failed_try_held(monkeypatch):
    """bench speed counts a step's FLOPs with checkpointing off and, where that runs out of memory, again with it on.
    The failed try's activations sit in the frames of the error's traceback, in a cycle (a local naming the error)
    that only the collector frees: the retry must start with them gone (Wan 14B's retry met the 138 GiB of the first
    try, H200, 2026-11-28). The collector is off here, so only an explicit collection frees them."""
    import gc
    import weakref
    from types import SimpleNamespace

    import torch

    from difftrain.flows import bench
    from difftrain.flows.bench import step_flops

    monkeypatch.setattr(bench, "FAKE_COUNT", False)  # the real count's memory handling

    class Activations:
        pass

    net = torch.nn.Linear(8, 8)
    net.gradient_checkpointing = True
    held: list[weakref.ref] = []
    seen_at_retry: list[bool] = []

    def loss(batch):
        if not net.gradient_checkpointing:  # the try without checkpointing: holds its activations and fails
            acts = Activations()
            held.append(weakref.ref(acts))
            err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 320.00 MiB")
            raise err  # err -> traceback -> this frame -> err: a cycle keeping acts
        seen_at_retry.append(held[0]() is None)
        return net(batch).square().mean()

    trainer = SimpleNamespace(
        cfg=SimpleNamespace(
            speed=SimpleNamespace(compile=False),
            train=SimpleNamespace(batch_size=1, grad_accum=1),
            memory=SimpleNamespace(
                activations=SimpleNamespace(kind="checkpoint", every=1, split=False, save_attention=False)
            ),
        ),
        device=torch.device("cpu"),
        family=SimpleNamespace(denoiser="transformer"),
        parts=SimpleNamespace(comps={"transformer": net}, optimizer=torch.optim.SGD(net.parameters(), lr=0.1)),
        feed=SimpleNamespace(items=[0], batch=lambda items: torch.ones(2, 8)),
        loss=loss,
    )
    was = gc.isenabled()
    gc.disable()
    try:
        flops, exact = step_flops(trainer)
    finally:
        if was:
            gc.enable()
    assert seen_at_retry == [True, True], "the retry started with the failed try's activations still held"
    # the checkpointed step (the Linear's forward and weight gradient) less its no-grad forward, the recompute
    assert exact is False and flops == 2 * (2 * 2 * 8 * 8) - 2 * 2 * 8 * 8
    assert net.gradient_checkpointing is True


def _tiny_trainer(net, loss, activations):
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        cfg=SimpleNamespace(
            speed=SimpleNamespace(compile=False),
            train=SimpleNamespace(batch_size=1, grad_accum=1),
            memory=SimpleNamespace(activations=activations),
        ),
        device=torch.device("cpu"),
        family=SimpleNamespace(denoiser="transformer"),
        parts=SimpleNamespace(comps={"transformer": net}, optimizer=torch.optim.SGD(net.parameters(), lr=0.1)),
        feed=SimpleNamespace(items=[0], batch=lambda items: torch.ones(2, 8)),
        loss=loss,
    )


def test_the_flop_count_never_runs_the_step_without_checkpoints_where_the_planner_says_it_does_not_fit(monkeypatch):
    """Running out of memory on a GPU is not always given back (Wan 14B's count after a failed try met 138 GiB
    still held and failed the whole bench run, H200, 2026-11-28): where the planner puts the step without checkpoints
    over the GPU, the count runs with them, and the recomputed forwards (split: twice, every 2nd block: half) come
    off."""
    from types import SimpleNamespace

    import torch

    from difftrain.flows import bench

    net = torch.nn.Linear(8, 8)
    net.gradient_checkpointing = True
    flags_seen: list[bool] = []

    def loss(batch):
        flags_seen.append(net.gradient_checkpointing)
        return net(batch).square().mean()

    forward = 2 * 2 * 8 * 8  # the Linear at batch 2; a step is its forward and its weight gradient
    monkeypatch.setattr(bench, "FAKE_COUNT", False)  # the real count (on fake tensors memory is no question)
    monkeypatch.setattr(bench, "_without_checkpoints_fits", lambda trainer: False)
    for split, every, share in ((False, 1, 1.0), (True, 1, 2.0), (False, 2, 0.5)):
        flags_seen.clear()
        act = SimpleNamespace(kind="checkpoint", every=every, split=split, save_attention=False)
        flops, exact = bench.step_flops(_tiny_trainer(net, loss, act))
        assert flags_seen == [True, True], "a step ran with checkpointing switched off"
        assert exact is False and flops == 2 * forward - share * forward
    monkeypatch.setattr(bench, "_without_checkpoints_fits", lambda trainer: True)
    flags_seen.clear()
    act = SimpleNamespace(kind="checkpoint", every=1, split=False, save_attention=False)
    assert bench.step_flops(_tiny_trainer(net, loss, act)) == (2 * forward, True)
    assert flags_seen == [False] and net.gradient_checkpointing is True


def test_with_save_attention_the_recompute_taken_off_leaves_the_kept_attentions_in(monkeypatch):
    """memory.activations.save_attention keeps the long attentions' outputs: the recompute runs the rest of each block
    only, so only the rest comes off the checkpointed count (Wan 14B's MFU read 48.7 % where the step without
    checkpoints counted 51.8 % at a slower step, H200, 2026-11-28). On the CPU no attention kernel has a FLOP formula,
    so the second Linear's matmul stands in for a kept attention here: its FLOPs stay in the model's count."""
    from types import SimpleNamespace

    import torch

    from difftrain.flows import bench
    from difftrain.memory import checkpoint_policy

    net = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    net.gradient_checkpointing = True

    def loss(batch):
        return net(batch).square().mean()

    # the second Linear's forward matmul: its weight, transposed, is the only [16, 8] operand of a forward
    monkeypatch.setattr(
        checkpoint_policy, "keeps", lambda op, args: op is torch.ops.aten.mm.default and args[1].shape == (16, 8)
    )
    monkeypatch.setattr(bench, "FAKE_COUNT", False)
    monkeypatch.setattr(bench, "_without_checkpoints_fits", lambda trainer: False)
    first, kept = 2 * 2 * 8 * 16, 2 * 2 * 16 * 8  # each Linear's forward at batch 2
    full = 3 * (first + kept) - 2 * 2 * 8 * 16  # forward, the input gradient of the second, both weight gradients
    plain = SimpleNamespace(kind="checkpoint", every=1, split=False, save_attention=False)
    count, exact = bench.step_flops(_tiny_trainer(net, loss, plain))
    assert exact is False and count == full - (first + kept)
    saved = SimpleNamespace(kind="checkpoint", every=1, split=False, save_attention=True)
    count, exact = bench.step_flops(_tiny_trainer(net, loss, saved))
    assert exact is False and count == full - first


def test_the_flop_count_gives_none_and_a_warning_where_even_the_checkpointed_step_runs_out_of_memory(
    capsys, monkeypatch
):
    """The run's times stand without an MFU, rather than the whole bench failing after its timed steps."""
    from types import SimpleNamespace

    import torch

    from difftrain.flows import bench

    monkeypatch.setattr(bench, "FAKE_COUNT", False)

    net = torch.nn.Linear(8, 8)
    net.gradient_checkpointing = True

    def loss(batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 432.00 MiB")

    act = SimpleNamespace(kind="checkpoint", every=1, split=False, save_attention=False)
    assert bench.step_flops(_tiny_trainer(net, loss, act)) is None
    assert "no MFU reported" in capsys.readouterr().err
    assert net.gradient_checkpointing is True


def test_the_planner_decides_whether_the_step_without_checkpoints_is_tried_on_a_gpu(monkeypatch):
    """Z-Image at 1024 px without checkpoints is planned at ~21 GiB reserved: tried with 80 GiB free, not with 16;
    Wan 14B at 81 frames of 480x832 has no figure for blocks without checkpoints: never tried."""
    from types import SimpleNamespace

    import torch

    from difftrain.config.load import resolve
    from difftrain.flows import bench

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    zimage = resolve("zimage-lora-12gb", None, []).config
    wan = resolve("wan-14b-lora-24gb", None, ["data.resolution=480", "data.frames=81"]).config
    for cfg, free_gib, fits in ((zimage, 80, True), (zimage, 16, False), (wan, 139, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, f=free_gib: (f * 2**30, 140 * 2**30))
        trainer = SimpleNamespace(cfg=cfg, device=torch.device("cuda", 0))
        assert bench._without_checkpoints_fits(trainer) is fits, (cfg.family, free_gib)


def test_a_flop_count_without_a_checkpointing_switch_that_runs_out_of_memory_gives_none(capsys, monkeypatch):
    """A compiled trainer's checkpointing sits inside its blocks, with diffusers' switches off: its count has no
    switch to try, and running out of memory there (Wan 14B in bf16, 81 frames of 480x832, H200, 2026-11-28) gives no
    MFU and a warning, not a failed bench run after its timed steps."""
    from types import SimpleNamespace

    import torch

    from difftrain.flows import bench

    monkeypatch.setattr(bench, "FAKE_COUNT", False)

    net = torch.nn.Linear(8, 8)
    net.gradient_checkpointing = False
    calls: list[int] = []

    def loss(batch):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 320.00 MiB")

    act = SimpleNamespace(kind="checkpoint", every=1, split=False, save_attention=False)
    assert bench.step_flops(_tiny_trainer(net, loss, act)) is None
    assert calls == [1] and "no MFU reported" in capsys.readouterr().err


def test_the_flop_count_runs_on_fake_tensors_with_checkpoints_off_and_falls_back_to_a_real_step(monkeypatch):
    """On fake tensors a step without checkpoints costs no memory: always counted exactly (Wan 14B at 81x480x832
    could not be, for real), and it counts what the real step counts; a loss that reads a value (data-dependent,
    which fake tensors cannot run) is counted for real. No fake gradient is left on the modules."""
    from types import SimpleNamespace

    import torch

    from difftrain.flows import bench

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    net.gradient_checkpointing = True
    seen: list[tuple[bool, bool]] = []
    reads = {"value": False}

    def loss(batch):
        from torch._subclasses.fake_tensor import FakeTensor

        seen.append((isinstance(batch, FakeTensor), net.gradient_checkpointing))
        out = net(batch).square().mean()
        if reads["value"]:
            out = out * (1.0 if out.item() > 0 else 2.0)  # data-dependent: not on fake tensors
        return out

    act = SimpleNamespace(kind="checkpoint", every=1, split=False, save_attention=False)
    monkeypatch.setattr(bench, "_without_checkpoints_fits", lambda trainer: False)  # for real: not tried
    fake = bench.step_flops(_tiny_trainer(net, loss, act))
    assert seen == [(True, False)]  # one fake step, checkpointing off although the real one would not fit
    assert all(p.grad is None for p in net.parameters())
    monkeypatch.setattr(bench, "FAKE_COUNT", False)
    monkeypatch.setattr(bench, "_without_checkpoints_fits", lambda trainer: True)
    assert bench.step_flops(_tiny_trainer(net, loss, act)) == fake and fake[1] is True
    monkeypatch.setattr(bench, "FAKE_COUNT", True)
    seen.clear()
    reads["value"] = True
    assert bench.step_flops(_tiny_trainer(net, loss, act)) == fake
    assert seen == [(True, False), (False, False)]  # the fake step stopped at .item(), the real one counted
