"""Verify service: owns the target model, its paged KV cache and the sequences."""
