"""Reference implementation of Megatron-Core -> SGLang MoE weight synchronization."""
