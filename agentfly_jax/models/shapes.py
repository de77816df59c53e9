"""Named model shapes (ModelConfig fields) used by benchmarks and experiments with random weights."""

SHAPES = {
    # Qwen2.5-0.5B: tied embeddings, qkv bias, 14 heads of 64, 2 kv heads
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                         num_kv_heads=2, tie_word_embeddings=True),
    # Qwen2.5-1.5B: tied embeddings, 12 heads of 128, 2 kv heads
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                         num_heads=12, num_kv_heads=2, tie_word_embeddings=True),
    # Qwen2.5-3B: tied embeddings, 16 heads of 128, 2 kv heads
    "qwen2.5-3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
                       num_heads=16, num_kv_heads=2, tie_word_embeddings=True),
    # Qwen2.5-7B: untied lm_head, 28 heads of 128, 4 kv heads (15 GB in bf16: the tensor-parallel sampler benchmark)
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, tie_word_embeddings=False),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                 num_kv_heads=2, tie_word_embeddings=True),
}
