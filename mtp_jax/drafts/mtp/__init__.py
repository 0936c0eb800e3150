"""MTP / NextN: DeepSeek-V3's own multi-token-prediction layer, chained K times (``draft``)."""
