"""How fast a step runs, never what it computes (within rounding). One module per concern:

- ``auto``: what each ``auto`` of the speed section becomes for a run (compile and CUDA graphs from measured
  costs, the attention kernel, GEGLU, channels-last, the LoRA kernel, the optimizer's kernels);
- ``regional_compile``: torch.compile on the family's repeated blocks, CUDA graphs (reduce-overhead), gradient
  checkpointing inside the compiled blocks, inductor's lasting caches;
- ``attention``: the scaled-dot-product-attention kernel of a step;
- ``memory_format``: channels-last convolutions;
- ``float8``: torchao's float8 training;
- ``measure``: the matmul peak MFU is measured against;
- the kernels of our own, each a torch custom op the compiler keeps: ``fa4`` (FlashAttention-4 for the long
  attention), ``geglu`` (SDXL's GEGLU backward in Triton), ``lora_kernel`` (the fused LoRA Linear and the
  attention processor that runs q, k and v as one call).
"""
