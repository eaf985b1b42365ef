"""LoRA in one place: ``adapters`` (peft adapters on a module: add, the trainable state, the layers to export),
``kohya`` (sd-scripts' key names and alphas), ``files`` (the LoRA files training writes and reads: diffusers/peft and
kohya layouts, modelspec metadata) and ``tools`` (``difftrain lora merge`` / ``resize``)."""
